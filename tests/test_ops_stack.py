"""Operating it, end to end on one stack: a real redis-server, a real Celery worker (prefork,
task events on, its /metrics server), the real API (``studio-code serve``), Docker
sandboxes, a SQLite run store.

* run history over HTTP and the CLI (``GET /api/runs``, ``studio-code runs``);
* what Celery's own tools see: a real event receiver (``app.events.Receiver``, what
  ``celery events``, Flower and celery-exporter use) gets task-failed for a failed node and
  task-revoked for a cancelled one; a revoke with terminate as Flower sends it (SIGTERM)
  ends a run ``cancelled``; ``inspect active_queues`` lists code.test;
* autoscaling signals and request metrics on both /metrics, every series present from the
  start, and ``promtool check metrics`` on both outputs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.api import read_sse
from testkit.processes import BIN, IN_CI, free_port, require, wait_for
from testkit.sandboxes import containers_of
from testkit.stack import DOCKER_PYTHON, Stack
from tests.conftest import run_cli
from tests.snippets import ADMIN, CGROUP_CODE, OK_CODE, RAISE_CODE, SLEEP_CODE, USER, cpu_share

pytestmark = [pytest.mark.docker, pytest.mark.redis]


class EventLog:
    """Celery events as a real receiver gets them (a thread of this test). Ready once it got
    its first event (the worker's, started with -E, beat every 2 s): Redis hands events to
    whoever subscribed when they were sent, so a job submitted before the receiver's
    subscription would have no events at all."""

    def __init__(self, broker: str) -> None:
        from celery import Celery

        self.app = Celery(broker=broker, set_as_current=False)
        self.events: list[dict[str, Any]] = []
        self._receiver: Any = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(60), "the event receiver got no event (not even a heartbeat)"

    def _got(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        self._ready.set()

    def _run(self) -> None:
        with self.app.connection() as conn:
            self._receiver = self.app.events.Receiver(conn, handlers={"*": self._got})
            self._receiver.capture(limit=None, timeout=None, wakeup=False)

    def of(self, job_id: str) -> list[str]:
        return [e["type"] for e in list(self.events) if e.get("uuid") == job_id]

    def wait_for(self, job_id: str, kind: str, timeout: float = 30) -> list[str]:
        wait_for(
            lambda: kind in self.of(job_id),
            timeout,
            f"a {kind} event for {job_id}",
            0.1,
            describe=lambda: self.of(job_id),
        )
        return self.of(job_id)

    def stop(self) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(5)


@pytest.fixture(scope="module")
def metrics_port() -> int:
    """The worker's /metrics server's port."""
    return free_port()


@pytest.fixture(scope="module")
def ops(
    tmp_path_factory: pytest.TempPathFactory,
    docker_client: Any,
    python_image: str,
    metrics_port: int,
) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("ops")
    (tmp / "prom").mkdir()
    with Stack(
        tmp,
        **DOCKER_PYTHON,
        code_image=python_image,
        metrics_port=metrics_port,
        metrics_ready_interval_s=0,
        code_max_memory="512m",
        code_max_cpus=1,
    ) as s:
        s.start_worker(
            f"ops{uuid.uuid4().hex[:6]}",
            3,
            extra_args=["-E"],
            env={"PROMETHEUS_MULTIPROC_DIR": str(tmp / "prom")},
        )
        s.start_api()
        yield s


@pytest.fixture(scope="module")
def events(ops: Stack) -> Iterator[EventLog]:
    """The task events of the module's worker (started with -E), as a receiver gets them."""
    log = EventLog(ops.redis_url)
    yield log
    log.stop()


def _user() -> str:
    return f"u-{uuid.uuid4().hex[:8]}"


# --- run history ------------------------------------------------------------------------


def test_run_history_over_http_and_cli(ops: Stack) -> None:
    alice, bob = _user(), _user()
    a_ok = [ops.submit(alice, OK_CODE, state={"n": i}) for i in range(3)]
    a_bad = ops.submit(alice, RAISE_CODE)
    b_ok = ops.submit(bob, OK_CODE)
    for job_id in [*a_ok, a_bad]:
        ops.until(job_id, alice, {"succeeded", "failed"})
    ops.until(b_ok, bob, {"succeeded"})

    r = ops.http.get("/api/runs", headers={USER: alice})
    assert r.status_code == 200, r.text
    runs = r.json()["runs"]
    assert [x["job_id"] for x in runs] == [a_bad, *reversed(a_ok)]  # newest first, own only
    assert r.json()["next_cursor"] is None
    for x in runs:
        assert x["code_runtime"] == "docker" and x["user"] == alice
        assert not {"code", "state_json", "output", "logs"} & set(x)

    # pages: one run each, the cursor carries on where the last page ended
    seen, cursor = [], None
    while True:
        params: dict[str, Any] = {"limit": 1}
        if cursor:
            params["cursor"] = cursor
        page = ops.http.get("/api/runs", params=params, headers={USER: alice}).json()
        seen += [x["job_id"] for x in page["runs"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [x["job_id"] for x in runs]

    failed = ops.http.get("/api/runs", params={"status": "failed"}, headers={USER: alice})
    assert [x["job_id"] for x in failed.json()["runs"]] == [a_bad]
    assert failed.json()["runs"][0]["error"]["code"] == "CODE_ERROR"

    # another user's runs: admins only
    r = ops.http.get("/api/runs", params={"user": bob}, headers={USER: alice})
    assert r.status_code == 403 and r.json()["error"]["code"] == "FORBIDDEN"
    r = ops.http.get("/api/runs", params={"user": bob}, headers={USER: "root", ADMIN: "1"})
    assert [x["job_id"] for x in r.json()["runs"]] == [b_ok]
    everyone = ops.http.get(
        "/api/runs", params={"limit": 200}, headers={USER: "root", ADMIN: "1"}
    ).json()["runs"]
    assert {a_bad, b_ok, *a_ok} <= {x["job_id"] for x in everyone}
    # bad input: a clear 422, never a 500
    for params in (
        {"cursor": "not-a-cursor"},
        {"limit": 0},
        {"status": "done"},
        {"since": "yesterday"},
    ):
        r = ops.http.get("/api/runs", params=params, headers={USER: alice})
        assert r.status_code == 422, (params, r.text)
        assert r.json()["error"]["code"] == "REQUEST_INVALID"
    assert ops.http.get("/api/runs").status_code == 401

    # the CLI reads the same store: one JSON object
    out = run_cli("runs", "--user", alice, "--status", "succeeded", "--limit", "2", env=ops.env())
    assert out.returncode == 0, out.stderr
    page = json.loads(out.stdout)
    assert [x["job_id"] for x in page["runs"]] == list(reversed(a_ok))[:2]
    assert page["next_cursor"] and page["error"] is None
    out = run_cli("runs", "--cursor", "zzz", env=ops.env())
    assert out.returncode == 1 and json.loads(out.stdout)["error"]["code"] == "REQUEST_INVALID"


# --- what Celery's tools see ------------------------------------------------------------------


def test_celery_events_show_failed_and_revoked(
    ops: Stack, events: EventLog, docker_client: Any
) -> None:
    user = _user()
    ok = ops.submit(user, OK_CODE)
    bad = ops.submit(user, RAISE_CODE)
    slow = ops.submit(user, SLEEP_CODE, state={"s": 60})
    assert "task-succeeded" in events.wait_for(ok, "task-succeeded")
    bad_events = events.wait_for(bad, "task-failed")
    failed_event = next(
        e for e in events.events if e.get("uuid") == bad and e["type"] == "task-failed"
    )
    assert "NodeFailed" in failed_event["exception"] and "CODE_ERROR" in failed_event["exception"]
    assert "task-succeeded" not in bad_events and "task-retried" not in bad_events

    ops.until(slow, user, {"running"})
    r = ops.http.post(f"/api/runs/{slow}/cancel", headers={USER: user})
    assert r.status_code == 202, r.text
    ops.until(slow, user, {"cancelled"}, timeout=15)
    events.wait_for(slow, "task-revoked")
    time.sleep(1)  # a late success, failure or second revoked event would come now
    slow_events = events.of(slow)
    assert slow_events.count("task-revoked") == 1, slow_events
    assert not {"task-succeeded", "task-failed"} & set(slow_events), slow_events

    # the store stays the truth and nothing ran again
    assert ops.run(bad, user)["status"] == "failed" and ops.run(bad, user)["attempts"] == 1
    assert ops.run(ok, user)["status"] == "succeeded"


def test_a_cancel_whose_revoke_never_arrived_is_still_a_revoked_task(
    ops: Stack, events: EventLog, docker_client: Any
) -> None:
    """The revoke broadcast is lost (or a busy worker's main process reads it only after the
    job's Redis flag ended it): the cancel goes to the store and the flag alone, as
    CodeClient.cancel writes them, and no revoke is sent. Celery's tools still see one
    task-revoked and no failure."""
    from executor.store import open_store
    from worker.protocol import cancel_key

    user = _user()
    job = ops.submit(user, SLEEP_CODE, state={"s": 60})
    ops.until(job, user, {"running"})
    with open_store(ops.database_url) as store:
        assert store.request_cancel(job) is not None
    import redis

    with redis.Redis.from_url(ops.redis_url) as r:
        r.set(cancel_key(job), "1", ex=600)
    body = ops.until(job, user, {"cancelled", "failed", "succeeded"}, timeout=30)
    assert body["status"] == "cancelled", body
    events.wait_for(job, "task-revoked")
    time.sleep(1)  # a late success, failure or second revoked event would come now
    events = events.of(job)
    assert events.count("task-revoked") == 1, events
    assert not {"task-succeeded", "task-failed"} & set(events), events
    assert ops.run(job, user)["attempts"] == 1


def test_revoke_terminate_as_flower_sends_it_ends_the_run_cancelled(
    ops: Stack, events: EventLog, docker_client: Any
) -> None:
    user = _user()
    job = ops.submit(user, SLEEP_CODE, state={"s": 60})
    ops.until(job, user, {"running"})
    deadline = time.monotonic() + 30
    while not containers_of(docker_client, job):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    # what Flower's "terminate" sends: revoke(terminate=True) with Celery's default signal,
    # SIGTERM, from an app that knows nothing of ours (Celery 5's CLI has no --terminate)
    from celery import Celery

    flower = Celery(broker=ops.redis_url, set_as_current=False)
    flower.control.revoke(job, terminate=True)
    body = ops.until(job, user, {"cancelled", "failed", "succeeded"}, timeout=30)
    flower.close()
    # cancelled by the product's cancel (before: running for minutes, then the reaper's
    # failed RUNTIME_UNAVAILABLE); the 30 s bound above is a hang guard, not a speed test
    assert body["status"] == "cancelled", body
    assert body["error"]["code"] == "CODE_CANCELLED"
    deadline = time.monotonic() + 10
    while containers_of(docker_client, job):
        assert time.monotonic() < deadline, "the sandbox outlived the revoke"
        time.sleep(0.1)
    assert "task-revoked" in events.wait_for(job, "task-revoked")
    # the pool process survived (a cancel, not a kill): the next job runs at once
    nxt = ops.submit(user, OK_CODE)
    assert ops.until(nxt, user, {"succeeded", "failed"})["status"] == "succeeded"


def test_inspect_active_queues_lists_code_test(ops: Stack) -> None:
    out = subprocess.run(
        [
            str(BIN / "celery"),
            "-A",
            "worker",
            "inspect",
            "active_queues",
            "--json",
            "--timeout",
            "5",
            "-d",
            ops.workers[0].node,
        ],
        env=ops.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    replies = json.loads(out.stdout)
    names = {q["name"] for reply in replies.values() for q in reply}
    assert {"code.test", "code.run"} <= names, replies


# --- metrics --------------------------------------------------------------------------


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _get(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def _promtool(text: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        require(not IN_CI, "promtool is not installed (Debian package prometheus)")
        return
    out = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_both_metrics_endpoints_have_every_series_and_pass_promtool(
    ops: Stack, metrics_port: int
) -> None:
    worker_text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).text
    w = _samples(worker_text)
    # present from the start, whatever ran before in this module
    for language in ("python", "typescript"):
        assert _get(w, "studio_code_sandboxes_running", language=language) is not None
        assert (
            _get(w, "studio_code_timeouts_total", language=language, runtime="docker") is not None
        )
    assert _get(w, "studio_code_worker_up", queue="code.run") == 1.0
    assert _get(w, "studio_code_worker_up", queue="code.test") == 1.0
    run_slots = [
        _get(w, "studio_code_worker_slots", queue="code.run", state=s) for s in ("busy", "idle")
    ]
    test_slots = [
        _get(w, "studio_code_worker_slots", queue="code.test", state=s) for s in ("busy", "idle")
    ]
    # -c 3 with one test slot: two processes for runs, one for tests, all idle now
    assert run_slots == [0.0, 2.0] and test_slots == [0.0, 1.0], (run_slots, test_slots)
    _promtool(worker_text)

    user = _user()
    ops.http.get("/api/runs", headers={USER: user})
    api_text = ops.http.get("/metrics").text
    a = _samples(api_text)
    assert (
        _get(a, "studio_code_http_requests_total", method="GET", route="/api/runs", status="2xx")
        or 0
    ) >= 1
    # a route nobody called yet is there at 0
    assert (
        _get(
            a,
            "studio_code_http_requests_total",
            method="POST",
            route="/api/code/test",
            status="5xx",
        )
        == 0.0
    )
    assert (
        _get(a, "studio_code_http_request_duration_seconds_count", method="GET", route="/api/runs")
        is not None
    )
    assert _get(a, "studio_code_queue_backlog", queue="code.run") == 0.0
    assert _get(a, "studio_code_queue_oldest_seconds", queue="code.test") == 0.0
    _promtool(api_text)


def test_a_busy_slot_shows_while_a_node_runs(ops: Stack, metrics_port: int) -> None:
    user = _user()
    job = ops.submit(user, SLEEP_CODE, state={"s": 60})
    ops.until(job, user, {"running"})
    w = _samples(httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).text)
    assert _get(w, "studio_code_worker_slots", queue="code.run", state="busy") == 1.0
    assert _get(w, "studio_code_worker_slots", queue="code.run", state="idle") == 1.0
    assert _get(w, "studio_code_sandboxes_running", language="python") == 1.0
    ops.http.post(f"/api/runs/{job}/cancel", headers={USER: user})
    ops.until(job, user, {"cancelled"})


def test_backlog_and_oldest_wait_with_no_worker(
    redis_server: Any, tmp_path: Path, make_settings: Any
) -> None:
    """Jobs sent through the real client to a Redis no worker reads: LLEN of the queue's
    list and the oldest queued job's age, as the API's collector reports them."""
    import redis

    from api_client.client import CodeClient
    from worker.autoscale import QueueCollector
    from worker.protocol import FAIR_BACKLOG_KEY, FAIR_MIN_AHEAD

    # no worker on purpose: the client must queue anyway instead of refusing (issue 8)
    settings = make_settings(
        redis_url=redis_server.url,
        code_runtime="subprocess",
        database_url=f"sqlite:///{tmp_path / 'r.db'}",
        queue_require_worker=False,
    )
    with CodeClient(settings) as client:
        for _ in range(3):
            client.submit(OK_CODE, kind="run")
        client.submit(OK_CODE, kind="test", user="t")
        time.sleep(1.1)
        r = redis.Redis.from_url(redis_server.url)
        fams = {f.name: f for f in QueueCollector(r, lambda: client.store).collect()}
        got = {
            (s.name, s.labels.get("queue") or s.labels.get("rank") or s.labels.get("mode")): s.value
            for f in fams.values()
            for s in f.samples
        }
        assert got[("studio_code_queue_backlog", "code.run")] == 3
        assert got[("studio_code_queue_backlog", "code.test")] == 1
        assert got[("studio_code_queue_oldest_seconds", "code.run")] >= 1.0
        # with no live worker, fairness lets FAIR_MIN_AHEAD runs into code.run, the rest
        # wait on their user's list (one bucket: no user): both count as backlog
        assert got[("studio_code_queue_fairness", "users")] == 1.0
        assert got[("studio_code_queue_user_waiting", "1")] == 3 - FAIR_MIN_AHEAD
        assert got[("studio_code_queue_users_waiting", None)] == 1.0
        # the keys KEDA's Redis list scaler reads: the queue's own name and the fair backlog
        assert r.llen("code.run") == FAIR_MIN_AHEAD
        assert r.llen("code.run") + r.llen(FAIR_BACKLOG_KEY) == 3
        r.close()


# --- per-node limits --------------------------------------------------------------------


def test_a_node_asks_for_its_own_limits_up_to_the_caps(ops: Stack) -> None:
    user = _user()
    # seen from INSIDE the sandbox: what the node asked for, not the server's default
    job = ops.submit(user, CGROUP_CODE, memory="384m", cpus=1)
    body = ops.until(job, user, {"succeeded", "failed"})
    assert body["status"] == "succeeded", body
    assert int(body["output"]["mem"]) == 384 * 1024 * 1024
    assert cpu_share(body["output"]) == 1.0
    assert body["memory_bytes"] == 384 * 1024 * 1024 and body["cpus"] == 1.0
    # and without asking: the defaults (STUDIO_CODE_MEMORY 256m, STUDIO_CODE_CPUS 0.5)
    job = ops.submit(user, CGROUP_CODE)
    body = ops.until(job, user, {"succeeded", "failed"})
    assert int(body["output"]["mem"]) == 256 * 1024 * 1024
    assert cpu_share(body["output"]) == 0.5

    # over a cap: CODE_INVALID naming the cap, at save time and at submit
    for extra, cap in [
        ({"memory": "1g"}, "STUDIO_CODE_MAX_MEMORY=512m"),
        ({"cpus": 2}, "STUDIO_CODE_MAX_CPUS=1"),
        ({"timeout_s": 60}, "STUDIO_CODE_MAX_SECONDS=15"),
        ({"memory": "lots"}, "512m"),
    ]:
        r = ops.http.post(
            "/api/code/validate", json={"code": OK_CODE, **extra}, headers={USER: user}
        )
        assert r.status_code == 400, (extra, r.text)
        assert (
            r.json()["error"]["code"] == "CODE_INVALID" and cap in r.json()["error"]["message"]
        ), r.text
    for extra in ({"memory": "1g"}, {"cpus": 2}):
        r = ops.http.post("/api/runs", json={"code": OK_CODE, **extra}, headers={USER: user})
        assert r.status_code == 400 and "STUDIO_CODE_MAX_" in r.json()["error"]["message"]
    r = ops.http.post(
        "/api/code/validate",
        json={"code": OK_CODE, "memory": "512m", "cpus": 1, "timeout_s": 15},
        headers={USER: user},
    )
    assert r.status_code == 200, r.text


# --- live logs --------------------------------------------------------------------------

PRINT_THEN_WORK = (
    "import sys, time\n"
    "def main(state):\n"
    "    print('first line', flush=True)\n"
    "    print('caf\\u00e9 ' * 3, flush=True)\n"
    "    time.sleep(state.get('s', 3))\n"
    "    print('second line', flush=True)\n"
    "    return 'done'\n"
)


def _sse(
    ops: Stack, job_id: str, user: str, headers: dict[str, str] | None = None, on_event: Any = None
) -> list[tuple[str, str, str | None]]:
    """Read the SSE stream to its end: [(event, data, id)]."""
    return read_sse(
        ops.http, f"/api/runs/{job_id}/logs?follow=1", {USER: user, **(headers or {})}, on_event
    )


def test_live_logs_arrive_while_the_node_runs(ops: Stack) -> None:
    user = _user()
    job = ops.submit(user, PRINT_THEN_WORK, state={"s": 3})
    seen_running: list[bool] = []

    def on_event(e: tuple[str, str, str | None]) -> None:
        if e[0] == "log" and "first line" in e[1] and not seen_running:
            # the node is still working: this arrived before its end
            seen_running.append(ops.run(job, user)["status"] == "running")

    events = _sse(ops, job, user, on_event=on_event)
    assert seen_running == [True], events
    assert events[-1][0] == "end"
    assert json.loads(events[-1][1]) == {"status": "succeeded", "logs_truncated": False}
    live = "".join(d for e, d, _ in events if e == "log")
    stored = ops.run(job, user)["logs"]
    assert live == stored and "café café" in live and "second line" in live  # the truth
    # a reconnect with Last-Event-ID resumes after that event
    first_id = next(i for e, d, i in events if e == "log" and "first line" in d)
    resumed = _sse(ops, job, user, headers={"Last-Event-ID": str(first_id)})
    text = "".join(d for e, d, _ in resumed if e == "log")
    assert "first line" not in text and "second line" in text
    # each part of an id at most 2^64-1, as Redis takes it: one over is 422 (Redis would
    # refuse it), the largest there is reads nothing after it and ends
    r = ops.http.get(
        f"/api/runs/{job}/logs",
        params={"follow": 1},
        headers={USER: user, "Last-Event-ID": "1-18446744073709551616"},
    )
    assert r.status_code == 422 and r.json()["error"]["code"] == "REQUEST_INVALID", r.text
    assert "2^64-1" in r.json()["error"]["message"], r.text
    top = _sse(ops, job, user, headers={"Last-Event-ID": f"{2**64 - 1}-{2**64 - 1}"})
    assert [e for e, _, _ in top] == ["end"], top
    # without follow: the stored logs as JSON; another user's run: 404
    r = ops.http.get(f"/api/runs/{job}/logs", headers={USER: user})
    assert r.json()["logs"] == stored and r.json()["finished"] is True
    assert (
        ops.http.get(
            f"/api/runs/{job}/logs", params={"follow": 1}, headers={USER: _user()}
        ).status_code
        == 404
    )


def test_live_logs_keep_the_cap_and_the_mark(ops: Stack) -> None:
    user = _user()
    flood = (
        "import sys\ndef main(state):\n"
        "    for i in range(3000):\n        print('x' * 60, i, flush=True)\n"
        "    return 1\n"
    )
    job = ops.submit(user, flood)
    events = _sse(ops, job, user)
    body = ops.run(job, user)
    assert body["logs_truncated"] is True
    live = "".join(d for e, d, _ in events if e == "log")
    [mark] = [d for e, d, _ in events if e == "truncated"]
    assert len(live.encode()) <= 64 * 1024
    assert live + mark == body["logs"], "live text + mark = the stored logs"
    assert json.loads(events[-1][1])["logs_truncated"] is True


def test_cli_logs_follow(ops: Stack) -> None:
    user = _user()
    job = ops.submit(user, PRINT_THEN_WORK, state={"s": 1})
    out = run_cli("logs", job, "--follow", env=ops.env(), timeout=120)
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert body["status"] == "succeeded" and "second line" in body["logs"]
    assert "first line" in out.stderr and "second line" in out.stderr
