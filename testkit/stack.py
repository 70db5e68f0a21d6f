"""The environment of the API and the workers, and the stack of one test or bench."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from testkit.processes import (
    BIN,
)
from testkit.worker import CeleryWorker


def studio_env(redis_url: str, database_url: str, image: str, **extra: Any) -> dict[str, str]:
    """The STUDIO_* environment an operator would give the API and the workers."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("STUDIO_") and k != "PROMETHEUS_MULTIPROC_DIR"
    }
    env.update(
        {
            "STUDIO_ENABLE_CODE_NODES": "1",
            "STUDIO_CODE_RUNTIME": "docker",
            "STUDIO_CODE_IMAGE": image,
            "STUDIO_CODE_LANGUAGES": "python",
            "STUDIO_REDIS_URL": redis_url,
            "STUDIO_DATABASE_URL": database_url,
            "STUDIO_CODE_MAX_SECONDS": "15",
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        }
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env


FAST = {
    "STUDIO_QUEUE_HEARTBEAT_INTERVAL_S": "0.5",
    "STUDIO_QUEUE_REAP_INTERVAL_S": "1",
    "STUDIO_CODE_RUNTIME": "subprocess",
    "STUDIO_CODE_LANGUAGES": "python",
}


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


class QueueEnv:
    """A redis-server, a run store, a client and the workers of one test."""

    def __init__(
        self,
        redis_url: str,
        database_url: str,
        tmp: Path,
        make_settings: Callable[..., Any],
        **overrides: Any,
    ) -> None:
        from api_client import CodeClient

        self.tmp = tmp
        self.redis_url = redis_url
        self.database_url = database_url
        self.overrides = {"code_concurrency": 2, **overrides}
        self.settings = make_settings(
            redis_url=redis_url, database_url=database_url, **self.overrides
        )
        self.client = CodeClient(self.settings)
        self.workers: list[CeleryWorker] = []

    def env(self, **extra: Any) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("STUDIO_")}
        env.update(
            {
                "STUDIO_ENABLE_CODE_NODES": "1",
                "STUDIO_REDIS_URL": self.redis_url,
                "STUDIO_DATABASE_URL": self.database_url,
                "STUDIO_DATA_DIR": str(self.tmp),
                "STUDIO_CODE_IMAGE": self.settings.code_image,
            }
        )
        for key, value in {**self.overrides, **extra}.items():
            env[f"STUDIO_{key.upper()}"] = str(value)
        return env

    def start_worker(
        self,
        name: str,
        concurrency: int = 2,
        *,
        cli: bool = False,
        ready_timeout_s: float = 60.0,
        extra_args: Sequence[str] = (),
        **extra_env: Any,
    ) -> CeleryWorker:
        worker = CeleryWorker(
            self.env(**extra_env),
            self.tmp / f"{name}.log",
            name=name,
            concurrency=concurrency,
            extra_args=extra_args,
            cli=cli,
            capture_stdout=cli,
            stop_timeout=25,
        )
        self.workers.append(worker)
        worker.wait_ready(ready_timeout_s, app=self.client.app)
        return worker

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        self.client.close()

    # helpers

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
