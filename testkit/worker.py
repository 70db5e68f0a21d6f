"""Celery workers (``celery -A worker worker`` or ``studio-code worker``) and a worker's
metrics server."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from testkit.processes import (
    BIN,
    HOST,
    Service,
    needs,
)


class CeleryWorker(Service):
    """``celery -A <app> worker --pool prefork -c N -Q <queues> -n <name>@%h`` (``app``: the
    studio's ``worker`` unless a bench gives its own), or, with ``cli``, ``studio-code
    worker`` with the same options (``queues=""``: no -Q, the queues of its worker group);
    ``extra_args`` go last.
    Not waited for: see ``wait_ready``."""

    def __init__(
        self,
        env: dict[str, str],
        log: Path,
        *,
        name: str | None = None,
        concurrency: int = 2,
        queues: str = "code.test,code.run",
        pool: str = "prefork",
        extra_args: Sequence[str] = (),
        cli: bool = False,
        capture_stdout: bool = False,
        stop_timeout: float | None = None,
        app: str = "worker",
        loglevel: str = "INFO",
    ) -> None:
        needs("redis", "a Celery worker")
        self.name = name or f"w{uuid.uuid4().hex[:6]}"
        #: the node name Celery gives it (``%h`` is this host's name)
        self.node = f"{self.name}@{HOST}"
        options = [
            "--pool",
            pool,
            "-c",
            str(concurrency),
            *(["-Q", queues] if queues else []),  # "": the worker's own (its group's)
            "-n",
            f"{self.name}@%h",
            "--loglevel",
            loglevel,
            *extra_args,
        ]
        if cli:
            argv = [str(BIN / "studio-code"), "worker", *options]
        else:
            argv = [str(BIN / "celery"), "-A", app, "worker", *options]
        super().__init__(argv, env, log, capture_stdout=capture_stdout, stop_timeout=stop_timeout)

    def wait_ready(self, timeout: float = 60.0, *, app: Any = None) -> CeleryWorker:
        """Until it is ready: it answers ``app``'s ping when a Celery app is given, else its
        log says `` ready.``. A worker that exits or stays unready fails the test (stopped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if app is not None:
                replies = app.control.ping(destination=[self.node], timeout=0.5)
                if any(self.node in r for r in replies or []):
                    return self
            elif " ready." in self.output():
                return self
            if not self.alive():
                break
            if app is None:
                time.sleep(0.2)
        if not self.alive():
            how = "exited"
        else:
            how = "did not answer ping" if app is not None else "did not say it is ready"
        out = self.output()[-4000:]
        self.stop(10)
        pytest.fail(f"the worker {self.name} {how}:\n{out}")


def start_worker(
    env: dict[str, str],
    log: Path,
    *,
    ready_timeout: float = 60.0,
    **options: Any,
) -> CeleryWorker:
    """A CeleryWorker (``options`` as CeleryWorker takes them) whose log says it is ready."""
    return CeleryWorker(env, log, **options).wait_ready(ready_timeout)


def health(port: int) -> tuple[int, dict[str, Any]]:
    """A worker's ``/healthz`` on ``port``: its status code and JSON body."""
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@contextmanager
def gated_heartbeat(
    redis_url: str, reason: list[str | None], slots: int, nodename: str = "gated@test"
) -> Iterator[Any]:
    """The worker's own heartbeat (worker.upkeep.heartbeat.Heartbeat) announcing
    ``nodename`` on code.run with ``slots``, paused while ``reason[0]`` is a sentence and
    serving once it is None (a test flips it): a worker's announcement without its pool."""
    from worker.upkeep.heartbeat import Heartbeat

    beat = Heartbeat(
        redis_url,
        nodename,
        {"code.run": slots},
        interval_s=0.2,
        ttl_s=1.6,
        not_serving_reason=lambda: reason[0],
    )
    beat.start()
    try:
        yield beat
    finally:
        beat.stop()
