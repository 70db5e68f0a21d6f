"""Every broker URL form works on every side (worker.broker): {``redis://``, ``sentinel://``
with one sentinel, with three} x {no passwords, the master's and the sentinels' passwords}
x {STUDIO_QUEUE_RUN_FAIRNESS users, off} x {``CodeClient.submit``, ``POST /api/runs`` of a
real API server, the ``studio-code submit`` CLI}: each cell submits a real job that a real
worker (a Celery worker process on the same URL form, subprocess runtime: the cell is about
the broker; the Sentinel failover test of tests/test_redis_faults.py runs the docker
runtime through three sentinels) runs to ``succeeded``, once.

Cheap by sharing: two Sentinel deployments (one without passwords, one with both) for the
whole module, each URL form its own Redis database on them (a queue of its own) with one
worker; per fairness setting one API server. The worker serves both fairness settings: a
worker reads STUDIO_QUEUE_RUN_FAIRNESS only for the per-user cap, which is off here.
"""

from __future__ import annotations

import json
import subprocess
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from testkit.api import ApiServer
from testkit.processes import BIN, wait_for
from testkit.sentinel import SentinelSet, start_sentinels
from testkit.stack import FAST_SETTINGS, Stack
from tests.snippets import USER

pytestmark = [pytest.mark.redis, pytest.mark.timeout(600)]

DOUBLE = "def main(state):\n    return state['n'] * 2\n"
MASTER_PASSWORD = "master-secret-1"
SENTINEL_PASSWORD = "sentinel-secret-1"

#: URL form -> (deployment: with passwords or not, sentinels in the URL (0: redis://), db)
FORMS = {
    "redis": (False, 0, 1),
    "redis-password": (True, 0, 1),
    "sentinel-1": (False, 1, 2),
    "sentinel-1-password": (True, 1, 2),
    # database 0: redis-py sends no SELECT, so a client that took a sentinel for Redis
    # connected fine and failed later, at the first declare (the reported symptom)
    "sentinel-3": (False, 3, 0),
    "sentinel-3-password": (True, 3, 0),
}
FAIRNESS = ("users", "off")
DOORS = ("client", "http", "cli")


@pytest.fixture(scope="module")
def deployments(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[bool, SentinelSet]]:
    """A primary, a replica and three sentinels without passwords, and the same with the
    master's password and the sentinels' own."""
    plain_dir = tmp_path_factory.mktemp("sentinels")
    secure_dir = tmp_path_factory.mktemp("sentinels-pw")
    with start_sentinels(plain_dir) as plain:
        with start_sentinels(
            secure_dir, password=MASTER_PASSWORD, sentinel_password=SENTINEL_PASSWORD
        ) as secure:
            yield {False: plain, True: secure}


class Form(Stack):
    """One URL form: a Stack on its URL (the subprocess runtime, a SQLite store of its own),
    one worker, an API server per fairness setting."""

    def __init__(self, name: str, workdir: Path, deployment: SentinelSet, secure: bool) -> None:
        _, sentinels, db = FORMS[name]
        d = deployment
        overrides: dict[str, Any] = {**FAST_SETTINGS, "code_max_seconds": 15}
        if sentinels:
            overrides["redis_sentinel_master"] = d.master
            if secure:
                overrides["redis_sentinel_password"] = SENTINEL_PASSWORD
        super().__init__(
            workdir,
            redis_url=d.sentinel_url(sentinels, db) if sentinels else d.primary_url(db),
            database_url=f"sqlite:///{workdir / 'store.db'}",
            **overrides,
        )
        self.name = name
        self.primary = (d.ports["a"], d.password)
        self.apis: dict[str, ApiServer] = {}
        self.worker = self.start_worker(f"w-{name}", stop_timeout=20, ping=False)

    @contextmanager
    def commands(self) -> Iterator[list[str]]:
        """The commands clients send the primary meanwhile (MONITOR), as text (not those a
        script runs)."""
        port, password = self.primary
        seen: list[str] = []
        mark = f"matrix-{uuid.uuid4().hex}"
        client = redis.Redis(port=port, password=password or None, socket_timeout=10)
        other = redis.Redis(port=port, password=password or None, socket_timeout=10)

        def watch() -> None:
            with client.monitor() as m:
                for event in m.listen():
                    command = str(event["command"])
                    if event.get("client_type") != "lua":
                        seen.append(command)
                    if mark in command and command.startswith("ECHO ") and "end" in command:
                        return

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        # on once it sees a command of its own
        wait_for(
            lambda: other.echo(f"{mark} start") and any(mark in c for c in seen), 10, "MONITOR on"
        )
        try:
            yield seen
        finally:
            other.echo(f"{mark} end")  # every command before it is read when it is
            thread.join(10)
            client.close()
            other.close()

    def fair_settings(self, fairness: str) -> Any:
        return self.settings_with(queue_run_fairness=fairness)

    def fair_env(self, fairness: str) -> dict[str, str]:
        return self.env(queue_run_fairness=fairness)

    def fair_api(self, fairness: str) -> ApiServer:
        if fairness not in self.apis:
            self.apis[fairness] = ApiServer(
                self.fair_env(fairness), self.workdir / f"api-{fairness}.log", log_level="warning"
            )
        return self.apis[fairness]

    def stop(self) -> None:
        for api in self.apis.values():
            api.stop()
        super().stop()


@pytest.fixture(scope="module", params=list(FORMS))
def form(
    request: pytest.FixtureRequest,
    deployments: dict[bool, SentinelSet],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Form]:
    name = request.param
    secure = FORMS[name][0]
    with Form(name, tmp_path_factory.mktemp(name), deployments[secure], secure) as f:
        f.worker.wait_ready(60)
        from api_client import CodeClient

        with CodeClient(f.fair_settings("off")) as c:  # until the worker is announced serving
            wait_for(
                lambda: any(i.serving for i in c.live_workers()["code.run"]),
                60,
                f"the worker on {name} serving code.run",
                0.2,
            )
        yield f


def _submit(form: Form, fairness: str, door: str, n: int) -> str:
    """Submit DOUBLE with state {n} through ``door``; returns its job id."""
    if door == "client":
        from api_client import CodeClient

        # a fresh client (a process's first submit is the one that failed through sentinels)
        with CodeClient(form.fair_settings(fairness)) as c:
            return str(c.submit(DOUBLE, "python", {"n": n}, user="ann"))
    if door == "http":
        r = httpx.post(
            f"{form.fair_api(fairness).base}/api/runs",
            json={"code": DOUBLE, "language": "python", "state": {"n": n}},
            headers={USER: "ann"},
            timeout=60,
        )
        assert r.status_code == 202, (r.status_code, r.text)
        return str(r.json()["job_id"])
    node = form.workdir / "double.py"
    node.write_text(DOUBLE)
    proc = subprocess.run(
        [str(BIN / "studio-code"), "submit", str(node), "--state", json.dumps({"n": n})]
        + ["--user", "ann"],
        env=form.fair_env(fairness),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return str(json.loads(proc.stdout)["job_id"])


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("fairness", FAIRNESS)
def test_a_job_submitted_through_each_door_runs_once(form: Form, fairness: str, door: str) -> None:
    from api_client import CodeClient

    n = 10 * DOORS.index(door) + FAIRNESS.index(fairness) + 1
    with form.commands() as seen:
        job_id = _submit(form, fairness, door, n)
    # how the message went: the fair-share script (its user's list) or kombu's LPUSH
    # (the enqueue script carries the message; the worker's end-of-job script only the id)
    scripted = [
        c for c in seen if c.startswith(("EVALSHA ", "EVAL ")) and job_id in c and '"headers"' in c
    ]
    pushed = [c for c in seen if c.startswith("LPUSH code.run ") and job_id in c]
    if fairness == "users":
        assert scripted and not pushed, f"the run did not go to its user's list: {pushed}"
    else:
        assert pushed and not scripted, f"the run did not go straight to code.run: {scripted}"
    with CodeClient(form.fair_settings(fairness)) as c:
        rec = c.wait(job_id, 60)
        counts = {status: n for status, n in c.store.counts_by_status().items() if n}
    assert rec.status == "succeeded", (rec.status, rec.error, form.worker.tail(30))
    assert rec.output == 2 * n
    assert rec.attempts == 1
    # a submit that failed (and was retried by hand) would leave a failed row behind
    assert set(counts) == {"succeeded"}, f"runs on {form.name}: {counts}"


# --- the broker layer's own parts, on a real Redis ---------------------------------------------


def test_a_publish_whose_declaration_moved_the_connection_on_is_sent_once(
    redis_server: Any, make_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kombu captures the producer's channel, then declares the queue with a retry of its
    own: when the declaration fails and that retry moves the connection to the URL's next
    part (the next sentinel://), the channel the producer holds is closed, and kombu's
    publish on it failed with "'NoneType' object has no attribute 'client'". The broker's
    channel raises a connection error there instead, so the publish is retried on the new
    channel (worker.broker.ChannelBase). Here the first part's user may not run SADD (what
    the declaration sends), the next two parts are the default user of the same Redis."""
    from kombu.transport import TRANSPORT_ALIASES

    from worker import broker
    from worker.assembly import make_app
    from worker.protocol import QUEUE_RUN, TASK_NAME

    client = redis.Redis.from_url(redis_server.url)
    client.acl_setuser(
        "nosadd", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
        commands=["+@all", "-sadd"],
    )  # fmt: skip
    # kombu takes the next part's transport by its scheme (as transport_for sets sentinel)
    monkeypatch.setitem(TRANSPORT_ALIASES, "redis", broker.TRANSPORT)
    app = make_app(make_settings(redis_url=redis_server.url, queue_run_fairness="off"))
    port = redis_server.port
    app.conf.broker_url = ";".join(
        [f"redis://nosadd:pw@127.0.0.1:{port}/0"] + [f"redis://127.0.0.1:{port}/0"] * 2
    )
    try:
        app.send_task(TASK_NAME, args=("j1",), task_id="j1", queue=QUEUE_RUN, ignore_result=True)
        ids = [json.loads(m)["headers"]["id"] for m in client.lrange(QUEUE_RUN, 0, -1)]
        assert ids == ["j1"]
    finally:
        client.close()
        app.close()


def test_the_next_sentinel_part_keeps_the_broker_layers_transport() -> None:
    """After a connection error kombu moves to the URL's next sentinel:// part and takes
    that part's transport by its scheme: it must be the broker layer's (fair share and
    poison handling), not kombu's own."""
    from kombu import Connection

    from worker import broker

    url = "sentinel://:pw@127.0.0.1:1/0;sentinel://127.0.0.1:2;sentinel://127.0.0.1:3"
    conn = Connection(url, transport=broker.transport_for(url))
    seen = []
    for _ in range(3):
        seen.append(type(conn.transport))
        conn.maybe_switch_next()
    assert seen == [broker.SentinelTransport] * 3
