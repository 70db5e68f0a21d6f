"""Real Flower, as docs/operations.md ("Celery's own tools") tells operators to run it:
workers started WITHOUT -E (`studio-code worker`), Flower pointed at the same Redis, its
``enable_events`` broadcast turning task events on. Flower's HTTP API then lists a node
that succeeded (SUCCESS), one that failed with CODE_ERROR (FAILURE) and one cancelled while
running (REVOKED).

Flower is not a dependency of the project: it gets a venv of its own, made once per
machine under ~/.cache/studio-code-test/ (keyed by the Flower version asked for) with pip
from the package index, and reused after (a laptop without network skips; CI=true fails).
The test's own redis-server, worker (subprocess runtime: the sandbox is not the point here)
and Flower on a free loopback port; only processes started here are stopped, by pid.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.processes import Service, free_port, require, wait_for
from testkit.redis import RedisServer
from testkit.stack import DOCKER_PYTHON, Stack
from tests.snippets import OK_CODE, RAISE_CODE, SLEEP_CODE

pytestmark = [pytest.mark.redis]

#: what pip installs into Flower's venv (kombu[redis]: the Redis transport, not a Flower dependency)
FLOWER_SPEC = "flower==2.2.*"
FLOWER_DEPS = ("kombu[redis]",)
#: the venv's folder: a new one when FLOWER_SPEC changes
FLOWER_VENV = (
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    / "studio-code-test"
    / f"flower-venv-{FLOWER_SPEC.split('==')[1].replace('*', 'x')}"
)


def flower_venv() -> Path:
    """The ``celery`` of Flower's venv, installed on first use (a lock file keeps two test
    processes from installing it at once; ``.complete`` marks a finished install)."""
    celery = FLOWER_VENV / "bin" / "celery"
    done = FLOWER_VENV / ".complete"
    FLOWER_VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(FLOWER_VENV.parent / f"{FLOWER_VENV.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists() and celery.exists():
            return celery
        steps = [
            [sys.executable, "-m", "venv", "--clear", str(FLOWER_VENV)],
            [str(FLOWER_VENV / "bin" / "pip"), "install", "-q", FLOWER_SPEC, *FLOWER_DEPS],
        ]
        for argv in steps:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
            require(
                out.returncode == 0,
                f"Flower's venv could not be made ({' '.join(argv[:4])}...): "
                f"{(out.stdout + out.stderr)[-2000:]}",
            )
        done.write_text(FLOWER_SPEC + "\n")
    return celery


class Flower(Service):
    """``celery --broker=URL flower`` from its own venv, on a free loopback port, its API
    open without a login (FLOWER_UNAUTHENTICATED_API), events enabled as by default."""

    stop_timeout = 10.0

    def __init__(self, celery: Path, broker: str, log: Path) -> None:
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("STUDIO_", "PYTHON"))}
        env["FLOWER_UNAUTHENTICATED_API"] = "true"
        argv = [
            str(celery),
            f"--broker={broker}",
            "flower",
            "--address=127.0.0.1",
            f"--port={self.port}",
        ]
        super().__init__(argv, env, log)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=10)

    def tasks(self) -> dict[str, Any]:
        r = self.http.get("/api/tasks")
        assert r.status_code == 200, r.text
        return dict(r.json())

    def answers(self) -> bool:
        try:
            return self.http.get("/healthcheck").status_code == 200
        except httpx.TransportError:
            assert self.alive(), f"Flower exited:\n{self.tail()}"
            return False


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Redis, a SQLite store, a client; its worker is started beside Flower (``flower``)."""
    with Stack(
        tmp_path_factory.mktemp("flower"),
        **{**DOCKER_PYTHON, "code_runtime": "subprocess"},
        code_image="studio-code:1",
    ) as s:
        yield s


@pytest.fixture(scope="module", params=["flower-first", "worker-first"])
def flower(request: pytest.FixtureRequest, stack: Stack) -> Iterator[tuple[Flower, Any, bool]]:
    """Flower and a worker beside it, started in either order (an operator starts them in
    any), and Flower's event receiver subscribed (``subscribed``); the worker stops at the
    end."""
    celery = flower_venv()
    # `studio-code worker` as the docs and deploy/compose.yaml start it: no -E
    name = f"fl{uuid.uuid4().hex[:6]}"
    if request.param == "worker-first":
        worker = stack.start_worker(name, 2, cli=True)
    with Flower(celery, stack.redis_url, stack.workdir / f"flower-{request.param}.log") as f:
        if request.param == "flower-first":  # Flower's first look finds no worker
            worker = stack.start_worker(name, 2, cli=True, ping=False)
            worker.wait_ready(60, app=stack.client.app)
        wait_for(f.answers, 60, "Flower's /healthcheck", 0.2)
        subscribed(stack, f)
        yield f, worker, request.param == "worker-first"
        f.http.close()
    worker.stop()


def subscribed(stack: Stack, flower: Flower) -> None:
    """Until Flower lists a probe task event sent by this test: its receiver is subscribed
    (Redis hands an event only to those subscribed when it is sent, so a job before this
    could be missing from Flower whatever the worker sent)."""
    probe = f"probe-{uuid.uuid4().hex[:8]}"
    with stack.client.app.events.default_dispatcher(hostname="probe@test") as dispatcher:

        def listed() -> bool:
            dispatcher.send("task-received", uuid=probe, name="probe")
            return probe in flower.tasks()

        wait_for(listed, 60, "Flower's event receiver subscribed", 0.5)


def test_flower_lists_succeeded_failed_and_revoked_nodes(
    stack: Stack, flower: tuple[Flower, Any, bool]
) -> None:
    client, (fl, worker, _worker_first) = stack.client, flower
    # Flower broadcasts enable_events every 5 s; the worker logs the first one it gets
    wait_for(
        lambda: "Events of group {task} enabled by remote" in worker.output(),
        60,
        "Flower's enable_events to reach the worker",
        0.2,
        describe=lambda: worker.tail(20),
    )
    ok = client.submit(OK_CODE, "python", {"n": 21})
    bad = client.submit(RAISE_CODE, "python", {})
    slow = client.submit(SLEEP_CODE, "python", {"s": 60})
    wait_for(lambda: client.status(slow).status.value == "running", 60, "the slow node running")
    client.cancel(slow)
    ended = {j: client.wait(j, timeout_s=60).status.value for j in (ok, bad, slow)}
    assert ended == {ok: "succeeded", bad: "failed", slow: "cancelled"}, ended
    assert client.status(bad).error.code.value == "CODE_ERROR"  # type: ignore[union-attr]

    want = {ok: "SUCCESS", bad: "FAILURE", slow: "REVOKED"}
    seen: dict[str, Any] = {}

    def listed() -> bool:
        nonlocal seen
        seen = {j: t.get("state") for j, t in fl.tasks().items() if j in want}
        return seen == want

    wait_for(listed, 30, "Flower listing the three nodes", 0.3, describe=lambda: seen)
    tasks = fl.tasks()
    # the failure is the node's: Flower shows the stored outcome's code and message
    assert "NodeFailed" in str(tasks[bad].get("exception")), tasks[bad]
    assert "CODE_ERROR" in str(tasks[bad].get("exception")), tasks[bad]
    assert {tasks[j].get("worker") for j in want} == {worker.node}, tasks
    # and still no worker event of Celery's heart (worker-online, a worker-heartbeat every
    # 2 s: the heartbeat's publish is what stalled the event loop): Flower counts the
    # worker's events by type. A worker whose consumer listens when Flower's receiver wakes
    # up (its one `heartbeat` broadcast) answers it with ONE worker-heartbeat: when the
    # worker started first, and also when Flower started first but its receiver came up
    # after the worker's consumer (a loaded host: seen in a CI run). A heartbeat every 2 s
    # for the test's length would be several, and worker-online one more key.
    r = fl.http.get("/workers", params={"json": 1})
    assert r.status_code == 200, r.text
    mine = [w for w in r.json()["data"] if w.get("hostname") == worker.node]
    assert mine and mine[0].get("task-succeeded"), r.json()
    heart = {k: n for k, n in mine[0].items() if k.startswith("worker-")}
    assert heart in ({}, {"worker-heartbeat": 1}), mine[0]


# --- task events while Redis is silent -------------------------------------------------------


def _publishes(dispatcher: Any) -> list[int]:
    """Counts the dispatcher's publish calls (each one a round trip to Redis, blocking the
    worker's event loop up to the socket timeout while Redis is silent)."""
    calls = [0]
    publish = dispatcher.producer.publish

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return publish(*args, **kwargs)

    dispatcher.producer.publish = counted
    return calls


def test_task_events_stop_trying_while_redis_is_silent(redis_server: RedisServer) -> None:
    """Task events on a connection that goes silent (testkit/relay.py), as a worker's loop
    sends them: each ended task buffers its event and flushes. Celery's dispatcher tries
    every kept event again at each flush (1 + 2 + 3 + 4 round trips for 4 events, each
    blocking the loop up to the socket timeout); ours (worker.consumer.events.QuietDispatcher)
    tries once, then keeps them, and the dispatcher made after the reconnect sends them."""
    from celery import Celery

    from testkit.relay import Relay
    from worker.consumer.events import QuietDispatcher

    options = {"socket_timeout": 0.5, "socket_connect_timeout": 0.5}
    kinds = {"groups": ["task"], "buffer_group": ["task"], "hostname": "w@test"}
    with Relay(redis_server.port) as relay:
        app = Celery(broker=relay.url(), set_as_current=False)
        app.conf.broker_transport_options = options
        with app.connection_for_write() as conn:
            before = QuietDispatcher(conn, **kinds)
            before.send("task-succeeded", uuid="warm-up")
            before.flush()  # connected, the fanout exchange declared
            calls = _publishes(before)
            relay.cut()
            for i in range(4):
                before.send("task-succeeded", uuid=f"cut-{i}")
                before.flush()
            tries = calls[0]
            relay.heal()
        assert tries == 1, f"{tries} round trips to a silent Redis for 4 events"
        # the consumer's reconnect: a new connection and dispatcher, which sends what the
        # old one kept (celery.worker.consumer.events.Events.start does this)
        with Listener(redis_server.url) as got, app.connection_for_write() as conn:
            after = QuietDispatcher(conn, **kinds)
            after.extend_buffer(before)
            after.flush()
            wait_for(lambda: len(got.uuids("cut-")) >= 4, 20, "the kept events", 0.1)
            assert sorted(got.uuids("cut-")) == [f"cut-{i}" for i in range(4)]
        app.close()


class Listener:
    """A real event receiver (what Flower runs) in a thread of the test, subscribed on
    entry: it has received a probe event sent after it started."""

    def __init__(self, broker: str) -> None:
        from celery import Celery

        self.app = Celery(broker=broker, set_as_current=False)
        self.events: list[dict[str, Any]] = []
        self.receiver: Any = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self.app.connection() as conn:
            self.receiver = self.app.events.Receiver(conn, handlers={"*": self.events.append})
            self.receiver.capture(limit=None, timeout=None, wakeup=False)

    def uuids(self, prefix: str) -> list[str]:
        return [str(e["uuid"]) for e in list(self.events) if str(e.get("uuid")).startswith(prefix)]

    def __enter__(self) -> Listener:
        self.thread.start()
        with self.app.events.default_dispatcher(hostname="probe@test") as probe:

            def heard() -> bool:
                probe.send("task-succeeded", uuid="probe")
                return bool(self.uuids("probe"))

            wait_for(heard, 20, "the event receiver subscribed", 0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.receiver is not None:
            self.receiver.should_stop = True
        self.thread.join(5)
        self.app.close()
