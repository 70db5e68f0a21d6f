"""The environment of the API and the workers, and the stack of one test or bench: Redis, a
run store, Celery workers and, when asked, the API (``Stack``)."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from testkit.api import ApiServer
from testkit.processes import BIN, ROOT, StopsOnExit, wait_for
from testkit.redis import RedisServer, start_redis
from testkit.worker import CeleryWorker

#: what an operator's API and workers run here unless told otherwise: Python nodes in Docker
#: sandboxes, 15 s at most (``studio_env``; a Stack given ``**DOCKER_PYTHON``)
DOCKER_PYTHON = {"code_runtime": "docker", "code_languages": "python", "code_max_seconds": 15}


def base_env() -> dict[str, str]:
    """This process's environment without its STUDIO_* and OTEL_* (nor its Prometheus
    multiprocess folder): what a process started with an environment of its own begins
    with. This checkout first on PYTHONPATH and the venv's bin first on PATH."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("STUDIO_", "OTEL_")) and k != "PROMETHEUS_MULTIPROC_DIR"
    }
    env["PATH"] = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return env


def as_env(settings: Mapping[str, Any]) -> dict[str, str]:
    """Settings by field name as the STUDIO_* variables that set them."""
    return {f"STUDIO_{key.upper()}": str(value) for key, value in settings.items()}


def studio_env(redis_url: str, database_url: str, image: str, **extra: Any) -> dict[str, str]:
    """The STUDIO_* environment an operator would give the API and the workers (``extra``:
    variables by their own names)."""
    env = base_env()
    env.update(as_env({**DOCKER_PYTHON, "code_image": image}))
    env.update(
        {
            "STUDIO_ENABLE_CODE_NODES": "1",
            "STUDIO_REDIS_URL": redis_url,
            "STUDIO_DATABASE_URL": database_url,
        }
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env


#: Stack.start_worker's arguments for a worker of group big (`studio-code worker --group
#: big`, its group's own queues) whose slot holds 1g and 1 CPU (STUDIO_WORKER_GROUPS=big:1g:1)
BIG_WORKER: dict[str, Any] = {
    "cli": True,
    "queues": "",
    "extra_args": ["--group", "big"],
    "code_max_memory": "1g",
    "code_max_cpus": 1,
}


FAST = {
    "STUDIO_QUEUE_HEARTBEAT_INTERVAL_S": "0.5",
    "STUDIO_QUEUE_REAP_INTERVAL_S": "1",
    "STUDIO_CODE_RUNTIME": "subprocess",
    "STUDIO_CODE_LANGUAGES": "python",
}


#: FAST as settings by field name (a Stack's ``overrides``)
FAST_SETTINGS = {k.removeprefix("STUDIO_").lower(): v for k, v in FAST.items()}


def env_for(redis_url: str, database_url: str, **extra: Any) -> dict[str, str]:
    return studio_env(redis_url, database_url, "studio-code:1", **{**FAST, **extra})


def client_for(make_settings: Any, redis_url: str, database_url: str, **overrides: Any) -> Any:
    from api_client import CodeClient

    base = {
        "code_runtime": "subprocess",
        "code_languages": "python",
        "queue_heartbeat_interval_s": 0.5,
    }
    settings = make_settings(
        redis_url=redis_url, database_url=database_url, **{**base, **overrides}
    )
    return CodeClient(settings)


class Stack(StopsOnExit):
    """Redis + a run store + Celery workers (+ the API) of one test or bench, in ``workdir``.

    ``overrides`` are settings by field name: the client's (``settings``, ``client``) and,
    as STUDIO_* variables, every process's (``env``). Without ``redis_url`` the stack starts
    a redis-server of its own; without ``database_url`` its store is a SQLite file in
    ``workdir``. ``env`` is more variables for every process (DOCKER_HOST, ...); ``quiet``
    (benches): workers log at WARNING and the API writes no access log. ``with`` it, or
    ``stop()``: the API, the workers, the client and its own redis-server end."""

    def __init__(
        self,
        workdir: Path,
        *,
        redis_url: str | None = None,
        database_url: str | None = None,
        env: Mapping[str, str] | None = None,
        quiet: bool = False,
        **overrides: Any,
    ) -> None:
        self.workdir = workdir
        self.redis: RedisServer | None = None
        if redis_url is None:
            self.redis = start_redis(workdir)
            redis_url = self.redis.url
        self.redis_url = redis_url
        self.database_url = database_url or f"sqlite:///{workdir / 'runs.db'}"
        self.extra_env = dict(env or {})
        self.quiet = quiet
        self.overrides = overrides
        self.workers: list[CeleryWorker] = []
        self.api: ApiServer | None = None
        self._settings: Any = None
        self._client: Any = None
        self._http: Any = None

    # --- what its processes and its client get -------------------------------------------

    @property
    def settings(self) -> Any:
        """The client's settings: as the processes' environment sets them."""
        if self._settings is None:
            self._settings = self.settings_with()
        return self._settings

    def settings_with(self, **extra: Any) -> Any:
        """The stack's settings with ``extra`` settings on top (as ``env(**extra)`` sets
        them for a process)."""
        from executor.settings import load_settings

        return load_settings(
            enable_code_nodes=True,
            data_dir=self.workdir,
            redis_url=self.redis_url,
            database_url=self.database_url,
            **{**self.overrides, **extra},
        )

    @property
    def client(self) -> Any:
        """A CodeClient of the stack (made on first use, closed by ``stop()``)."""
        if self._client is None:
            from api_client import CodeClient

            self._client = CodeClient(self.settings)
        return self._client

    def env(self, **extra: Any) -> dict[str, str]:
        """The environment of its processes: ``extra`` settings on top of the stack's."""
        env = base_env()
        env.update(self.extra_env)
        env.update(
            {
                "STUDIO_ENABLE_CODE_NODES": "1",
                "STUDIO_REDIS_URL": self.redis_url,
                "STUDIO_DATABASE_URL": self.database_url,
                "STUDIO_DATA_DIR": str(self.workdir),
            }
        )
        if "code_image" not in self.overrides:
            env["STUDIO_CODE_IMAGE"] = str(self.settings.code_image)
        env.update(as_env({**self.overrides, **extra}))
        return env

    # --- its processes -------------------------------------------------------------------

    def start_worker(
        self,
        name: str | None = None,
        concurrency: int = 2,
        *,
        cli: bool = False,
        capture_stdout: bool = False,
        ready_timeout_s: float = 60.0,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        ping: bool = True,
        app: str = "worker",
        queues: str = "code.test,code.run",
        stop_timeout: float = 25,
        **extra: Any,
    ) -> CeleryWorker:
        """A worker (``celery -A <app> worker``, or ``studio-code worker`` with ``cli``),
        ``extra`` settings and ``env`` variables on top of the stack's, its log
        ``<name>.log`` in ``workdir`` (its stdout a pipe with ``capture_stdout``); ready
        when it answers the client's ping (with ``ping``, else not waited for:
        ``wait_ready``)."""
        name = name or f"w{uuid.uuid4().hex[:6]}"
        worker = CeleryWorker(
            {**self.env(**extra), **(env or {})},
            self.workdir / f"{name}.log",
            name=name,
            concurrency=concurrency,
            queues=queues,
            extra_args=extra_args,
            cli=cli,
            capture_stdout=capture_stdout,
            stop_timeout=stop_timeout,
            app=app,
            loglevel="WARNING" if self.quiet else "INFO",
        )
        self.workers.append(worker)
        if ping:
            worker.wait_ready(ready_timeout_s, app=self.client.app)
        return worker

    def start_api(
        self, *, env: Mapping[str, str] | None = None, ready_timeout: float = 30.0, **extra: Any
    ) -> ApiServer:
        """``studio-code serve`` (one per stack), ``extra`` settings and ``env`` variables on
        top of the stack's; ``http`` then calls it (with the API token, when there is one)."""
        assert self.api is None, "a stack runs one API"
        self.api = ApiServer(
            {**self.env(**extra), **(env or {})},
            self.workdir / "api.log",
            ready_timeout=ready_timeout,
            log_level="warning" if self.quiet else None,
        )
        return self.api

    @property
    def base(self) -> str:
        assert self.api is not None, "start_api() first"
        return self.api.base

    @property
    def auth(self) -> dict[str, str]:
        """The Authorization header of the stack's API token ({} without one)."""
        token = self.overrides.get("api_token")
        return {"Authorization": f"Bearer {token}"} if token else {}

    @property
    def http(self) -> Any:
        """An httpx client of the API (with ``auth``), made on first use."""
        if self._http is None:
            import httpx

            self._http = httpx.Client(base_url=self.base, timeout=90, headers=self.auth)
        return self._http

    def stop(self) -> None:
        """The API, the workers, the client and its own redis-server end (again: nothing)."""
        if self._http is not None:
            self._http.close()
            self._http = None
        if self.api is not None:
            self.api.stop()
        for w in self.workers:
            w.stop()
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.redis is not None:
            self.redis.stop()

    # --- over HTTP -----------------------------------------------------------------------

    @staticmethod
    def as_user(user: str, admin: bool = False) -> dict[str, str]:
        """The headers of a call by ``user`` (an admin's with ``admin``)."""
        from api_client.http.docs import ADMIN_HEADER, USER_HEADER

        return {USER_HEADER: user, **({ADMIN_HEADER: "1"} if admin else {})}

    def submit(self, user: str, code: str, **body: Any) -> str:
        """POST /api/runs as ``user``: the job id."""
        r = self.http.post("/api/runs", json={"code": code, **body}, headers=self.as_user(user))
        assert r.status_code == 202, r.text
        return str(r.json()["job_id"])

    def run(self, job_id: str, user: str) -> dict[str, Any]:
        """GET /api/runs/<job_id> as ``user``."""
        r = self.http.get(f"/api/runs/{job_id}", headers=self.as_user(user))
        assert r.status_code == 200, r.text
        return dict(r.json())

    def until(
        self, job_id: str, user: str, statuses: set[str] | None = None, timeout: float = 60.0
    ) -> dict[str, Any]:
        """The run once in one of ``statuses`` (None: once finished), over HTTP."""
        body: dict[str, Any] = {}

        def reached() -> dict[str, Any] | None:
            nonlocal body
            body = self.run(job_id, user)
            done = body["finished"] if statuses is None else body["status"] in statuses
            return body if done else None

        what = f"run {job_id} {'finished' if statuses is None else 'in ' + str(sorted(statuses))}"
        return dict(wait_for(reached, timeout, what, 0.05, describe=lambda: body))

    # --- over the queue ------------------------------------------------------------------

    def done_count(self, job_id: str) -> int:
        from worker.protocol import done_key

        return int(self.client.redis.llen(done_key(job_id)))

    def wait_all(self, job_ids: list[str], timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            recs = self.client.store.get_many(job_ids)
            if all(r.finished for r in recs.values()) and len(recs) == len(job_ids):
                return recs
            if time.monotonic() > deadline:
                open_ = [j for j in job_ids if j not in recs or not recs[j].finished]
                tails = "\n".join(w.tail(30) for w in self.workers)
                raise AssertionError(f"{len(open_)} jobs not finished: {open_[:5]}\n{tails}")
            time.sleep(0.1)
