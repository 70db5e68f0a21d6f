"""The control plane under faults, with real processes: a real redis-server (the test's own),
real Celery worker processes, a real uvicorn API, SQLite files and the shared PostgreSQL
(reached through a loopback TCP relay the test can cut, to make the store "go down").

* no live worker serves a queue: a submit is refused at once, nothing is left queued;
* workers announce themselves per queue (heartbeat), and stop counting when they stop;
* the queued sweep re-sends a job whose message was lost (never sent, or consumed while the
  worker's store was down), and the queue-wait bound ends a job no worker took;
* API and worker on different run stores: a clear error naming both, never a silent wait;
* an unreadable row ends failed cleanly and GET /api/runs/{id} still answers 200;
* an unreachable run store is RUNTIME_UNAVAILABLE (503) naming the store, no raw error.

Workers here use the subprocess runtime (no sandbox is needed to test who takes a job);
every process is started by the test and stopped by its pid.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.api import ApiServer
from testkit.processes import Service, wait_for
from testkit.redis import take_lost
from testkit.relay import ClosingRelay
from testkit.stack import client_for, env_for
from testkit.worker import CeleryWorker, gated_heartbeat, start_worker
from tests.snippets import TRIVIAL, USER

pytestmark = [pytest.mark.redis]


@pytest.fixture
def procs() -> Iterator[list[Service]]:
    """Processes of the test, stopped (by pid) at the end."""
    started: list[Service] = []
    yield started
    for p in started:
        p.stop(30)


def sqlite(tmp_path: Path, name: str) -> str:
    return f"sqlite:///{tmp_path / name / 'studio-code.db'}"


# --- fail fast when no worker serves -----------------------------------------------------------


def test_submit_with_no_worker_is_refused_at_once(
    redis_server: Any, tmp_path: Path, make_settings: Any
) -> None:
    from api_client import RuntimeUnavailable

    with client_for(make_settings, redis_server.url, sqlite(tmp_path, "s")) as client:
        for kind, queue in (("run", "code.run"), ("test", "code.test")):
            with pytest.raises(RuntimeUnavailable) as caught:
                client.submit(TRIVIAL, "python", {"n": 1}, kind=kind, user="ann")
            assert caught.value.code == "RUNTIME_UNAVAILABLE"
            assert f"No worker is serving {queue}: start one with `studio-code worker`" in (
                caught.value.message
            )
        assert sum(client.store.counts_by_status().values()) == 0, "no row may be left"
        # the rate limit did not count refused test calls
        assert client.redis.zcard("studio:rate:test:ann") == 0
        # an inline run needs no worker
        assert client.run_inline(TRIVIAL, "python", {"n": 2}).output == 4


def test_a_paused_worker_does_not_count_and_says_why(
    redis_server: Any, tmp_path: Path, make_settings: Any
) -> None:
    """The heartbeat itself (worker.upkeep.heartbeat.Heartbeat) on a real Redis: while its
    not_serving_reason gives a sentence, the worker is announced paused, the API refuses
    and quotes the reason; once it answers None again, submits pass."""
    from api_client import RuntimeUnavailable

    reason: list[str | None] = ["Docker is not reachable at unix:///nowhere.sock"]
    with gated_heartbeat(redis_server.url, reason, slots=3):
        with client_for(
            make_settings, redis_server.url, sqlite(tmp_path, "s"), queue_heartbeat_interval_s=0.2
        ) as client:
            live = client.live_workers()
            assert [w.nodename for w in live["code.run"]] == ["gated@test"]
            assert live["code.run"][0].state == "paused" and live["code.test"] == []
            with pytest.raises(RuntimeUnavailable) as caught:
                client.submit(TRIVIAL, "python", {})
            assert "Paused: gated@test (Docker is not reachable" in caught.value.message
            reason[0] = None
            wait_for(lambda: client.live_workers()["code.run"][0].serving, 3, "serving")
            job = client.submit(TRIVIAL, "python", {})
            assert client.status(job).status == "queued"
            meta = client.meta()
            assert meta["workers"]["code.run"] == {"serving": 1, "slots": 3, "paused": []}
            assert meta["workers"]["code.test"]["serving"] == 0


def test_heartbeat_comes_and_goes_with_worker_processes(
    redis_server: Any, tmp_path: Path, make_settings: Any, procs: list[Service]
) -> None:
    from api_client import RuntimeUnavailable

    db = sqlite(tmp_path, "s")
    env = env_for(redis_server.url, db)
    with client_for(make_settings, redis_server.url, db) as client:
        w1 = start_worker(env, tmp_path / "w1.log", name="hb1", concurrency=3)
        procs.append(w1)
        live = client.live_workers()
        [run], [test] = live["code.run"], live["code.test"]
        assert run.nodename.startswith("hb1@") and run.serving and run.pid == w1.pid
        assert (run.slots, test.slots) == (2, 1), "3 processes: 1 kept for code.test"
        assert run.store_id == client.store.store_id and run.store_id
        job = client.submit(TRIVIAL, "python", {"n": 21})
        assert client.wait(job, 30).output == 42
        assert f"run store: {db} (store id {client.store.store_id})" in w1.output()

        # a warm stop withdraws the announcement at once
        assert w1.stop(30) == 0
        assert client.live_workers() == {"code.test": [], "code.run": []}
        time.sleep(1.1)  # past the client's 1 s "served" cache
        with pytest.raises(RuntimeUnavailable, match="No worker is serving code.run"):
            client.submit(TRIVIAL, "python", {})

        # a killed worker stops counting once its last beat expires (3 x 0.5 + 1 s)
        w2 = start_worker(env, tmp_path / "w2.log", name="hb2", concurrency=2)
        procs.append(w2)
        assert [w.nodename.split("@")[0] for w in client.live_workers()["code.run"]] == ["hb2"]
        w2.signal(9)
        # bounded by wait_for (a hang guard); how fast is the TTL's business, not a test's
        wait_for(lambda: not client.live_workers()["code.run"], 10, "the announcement to expire")
    assert not list(Path(".").glob("data")), "nothing was created in the current folder"


# --- nothing stays queued without an owner -----------------------------------------------------


def test_queued_sweep_resends_a_lost_message_and_ends_overdue_jobs(
    redis_server: Any, tmp_path: Path, make_settings: Any, procs: list[Service]
) -> None:
    from executor.models import CodeJob
    from executor.store import open_store

    db = sqlite(tmp_path, "s")
    # This worker serves code.run only; code.test calls may wait 3 s at most.
    env = env_for(
        redis_server.url,
        db,
        STUDIO_QUEUE_LOST_AFTER_S="1",
        STUDIO_QUEUE_TEST_MAX_WAIT_S="3",
        STUDIO_QUEUE_TEST_SLOTS="0",
    )
    with client_for(
        make_settings, redis_server.url, db, queue_require_worker=False, queue_test_max_wait_s=3
    ) as client:
        # A row whose message never reached Redis (an API that died in between).
        lost = CodeJob(code=TRIVIAL, state_json='{"n": 5}', kind="run", user="ann")
        with open_store(db) as store:
            assert store.create(lost, code_runtime="subprocess")
        # An editor test call no worker serves: it may wait 3 s, then it ends failed.
        orphan = client.submit(TRIVIAL, "python", {}, kind="test", user="ann")
        w = CeleryWorker(
            env, tmp_path / "sweep.log", name="sweep", concurrency=1, queues="code.run"
        )
        procs.append(w)
        rec = client.wait(lost.job_id, 30)
        assert rec.status == "succeeded" and rec.output == 10, w.output()[-3000:]
        assert rec.attempts == 1
        assert "sent again" in w.output()
        ended = client.wait(orphan, 30)
        assert ended.status == "failed" and ended.started_at is None, ended
        assert ended.error and ended.error.code == "RUNTIME_UNAVAILABLE"
        assert "No worker took this job within 3 s" in ended.error.message
        assert "STUDIO_QUEUE_TEST_MAX_WAIT_S" in ended.error.message


#: a run that takes a few seconds and says what it was given (long enough for a second copy
#: of its message to arrive while it runs)
SLOW = "import time\n\ndef main(state):\n    time.sleep(4)\n    return state['n'] * 2\n"


def test_a_delivery_its_worker_lost_is_sent_again_past_the_bound_and_not_before(
    redis_server: Any, tmp_path: Path, make_settings: Any
) -> None:
    """A job still queued whose message sits in kombu's unacked hash (taken by a worker
    that never claimed it): within STUDIO_QUEUE_HELD_LOST_AFTER_S it is a live worker's and
    the sweep leaves it; past it (the delivery made longer ago, as a worker that lost its
    message with a failed-over primary leaves it) the stale delivery is removed from the
    hash and the index and the job sent again, once."""
    from worker.protocol import KOMBU_UNACKED, KOMBU_UNACKED_INDEX, message_job_id, queue_lists
    from worker.upkeep.queued import QueuedSweep

    with client_for(
        make_settings,
        redis_server.url,
        sqlite(tmp_path, "s"),
        queue_require_worker=False,
        queue_run_fairness="off",
        queue_lost_after_s=0.2,
        queue_held_lost_after_s=30,
    ) as client:
        r = client.redis
        job = client.submit(TRIVIAL, "python", {"n": 1})
        tag = take_lost(client.app, "code.run")
        time.sleep(0.3)  # past STUDIO_QUEUE_LOST_AFTER_S
        sweep = QueuedSweep(client.settings, client.store, client.app, "sweeper@test")
        try:
            assert sweep.resend_lost() == [], "a delivery within the bound is a live worker's"
            assert r.hexists(KOMBU_UNACKED, tag) and r.zscore(KOMBU_UNACKED_INDEX, tag)
            assert sum(int(r.llen(k)) for k in queue_lists("code.run")) == 0
            # the same delivery, made 31 s ago: its worker would have claimed it by now
            r.zadd(KOMBU_UNACKED_INDEX, {tag: time.time() - 31}, xx=True)
            assert sweep.resend_lost() == [job]
            assert not r.hexists(KOMBU_UNACKED, tag) and r.zscore(KOMBU_UNACKED_INDEX, tag) is None
            sent = r.lrange("code.run", 0, -1)
            assert [message_job_id(m) for m in sent] == [job], "sent again, once"
            assert not json.loads(sent[0])["properties"]["delivery_info"].get("redelivered"), (
                "a first delivery (it claims only a queued job)"
            )
            assert sweep.resend_lost() == [], "its message is in code.run now"
            assert client.status(job).status == "queued"
        finally:
            sweep.close()


def test_a_run_whose_worker_lost_its_message_runs_once_within_the_bound(
    redis_server: Any, tmp_path: Path, make_settings: Any, procs: list[Service]
) -> None:
    """Redis keeps a delivery whose worker lost the message (as a Sentinel failover leaves
    it: the new primary has the delivery, the worker that took it dropped it with the old
    primary's connection; kombu would hand it out only after its visibility timeout, 150 s
    here): a real worker's sweep sends the job again within STUDIO_QUEUE_HELD_LOST_AFTER_S +
    a sweep, and it succeeds exactly once; the first holder's copy, arriving while the job
    runs (a slow holder, not a dead one), is skipped: one attempt, one result."""
    from worker.protocol import KOMBU_UNACKED, KOMBU_UNACKED_INDEX

    db = sqlite(tmp_path, "s")
    settings = {
        "STUDIO_QUEUE_LOST_AFTER_S": "1",
        "STUDIO_QUEUE_HELD_LOST_AFTER_S": "3",
        "STUDIO_QUEUE_RUN_FAIRNESS": "off",
        "STUDIO_QUEUE_TEST_SLOTS": "0",
        "STUDIO_CODE_MAX_SECONDS": "15",
    }
    env = env_for(redis_server.url, db, **settings)
    with client_for(
        make_settings,
        redis_server.url,
        db,
        queue_require_worker=False,
        queue_run_fairness="off",
        code_max_seconds=15,
    ) as client:
        r = client.redis
        job = client.submit(SLOW, "python", {"n": 21})
        tag = take_lost(client.app, "code.run")
        held = r.hget(KOMBU_UNACKED, tag)
        assert held is not None
        r.zadd(KOMBU_UNACKED_INDEX, {tag: time.time() - 10}, xx=True)  # taken 10 s ago
        w = CeleryWorker(env, tmp_path / "held.log", name="held", concurrency=2, queues="code.run")
        procs.append(w)
        wait_for(
            lambda: client.status(job).status != "queued",
            30,
            "the sweep to send the job again and the worker to claim it",
        )
        assert "sent again" in w.output()
        # the first holder's copy (a first delivery), while the job runs
        r.lpush("code.run", json.dumps(json.loads(held)[0]))
        wait_for(lambda: r.llen("code.run") == 0, 10, "the worker to take the first copy")
        assert client.status(job).status == "running", "the copy arrived while the job ran"
        rec = client.wait(job, 30)
        assert rec.status == "succeeded" and rec.output == 42, w.output()[-3000:]
        assert rec.attempts == 1, f"the job was claimed {rec.attempts} times"
        wait_for(lambda: r.hlen(KOMBU_UNACKED) == 0, 10, "both copies acknowledged")
        assert client.status(job).attempts == 1


def test_a_job_past_its_wait_bound_ends_even_with_no_worker_left(
    redis_server: Any, tmp_path: Path, make_settings: Any
) -> None:
    """No worker at all (so no janitor): reading the job ends it once it is overdue."""
    with client_for(
        make_settings,
        redis_server.url,
        sqlite(tmp_path, "s"),
        queue_require_worker=False,
        queue_run_max_wait_s=1,
    ) as client:
        job = client.submit(TRIVIAL, "python", {})
        assert client.status(job).status == "queued"
        time.sleep(1.2)
        rec = client.status(job)
        assert rec.status == "failed" and "No worker took this job within 1 s" in (
            rec.error.message if rec.error else ""
        )
        assert client.store.counts_by_status()["queued"] == 0


# --- one store, said plainly -------------------------------------------------------------------


def test_api_and_worker_on_different_stores(
    redis_server: Any, tmp_path: Path, make_settings: Any, procs: list[Service]
) -> None:
    from api_client import RuntimeUnavailable

    worker_db, api_db = sqlite(tmp_path, "worker"), sqlite(tmp_path, "api")
    w = start_worker(env_for(redis_server.url, worker_db), tmp_path / "w.log", name="other")
    procs.append(w)
    with client_for(make_settings, redis_server.url, api_db) as client:
        # Refused at once: the only worker announces another store.
        with pytest.raises(RuntimeUnavailable) as caught:
            client.submit(TRIVIAL, "python", {})
        message = caught.value.message
        assert "ANOTHER run store" in message and worker_db.split("///")[1] in message
        assert api_db.split("///")[1] in message and client.store.store_id in message
        assert client.store.counts_by_status()["queued"] == 0
    # With the check off, the job reaches that worker: it says so at ERROR and the waiter
    # ends at once with both stores named, never a silent wait.
    with client_for(make_settings, redis_server.url, api_db, queue_require_worker=False) as client:
        job = client.submit(TRIVIAL, "python", {})
        rec = client.wait(job, 30)
        # finished (not a wait that ran out with the job still queued)
        assert rec.finished and rec.status == "failed" and rec.error, rec
        assert rec.error.code == "RUNTIME_UNAVAILABLE"
        assert client.store.store_id in rec.error.message
        assert worker_db.split("///")[1] in rec.error.message
        assert "same STUDIO_DATABASE_URL" in rec.error.message
    assert "ERROR" in w.output() and f"job {job} is not in this worker's run store" in (w.output())


def test_status_of_a_missing_store_creates_nothing(tmp_path: Path, redis_server: Any) -> None:
    from tests.conftest import run_cli

    data = tmp_path / "nowhere"
    proc = run_cli(
        "status",
        "abc",
        env={
            "STUDIO_DATA_DIR": str(data),
            "STUDIO_REDIS_URL": redis_server.url,
            "STUDIO_DATABASE_URL": "",
        },
    )
    out = json.loads(proc.stdout)
    assert proc.returncode == 1 and out["error"]["code"] == "RUNTIME_UNAVAILABLE", proc.stdout
    assert str(data / "studio-code.db") in out["error"]["message"]
    assert not data.exists(), "status must not create the store's folder"

    from executor.models import CodeJob
    from executor.store import open_store

    url = f"sqlite:///{tmp_path / 'there' / 'studio-code.db'}"
    job = CodeJob(code=TRIVIAL)
    with open_store(url) as store:
        store.create(job, code_runtime="subprocess")
    env = {"STUDIO_DATABASE_URL": url, "STUDIO_REDIS_URL": redis_server.url}
    found = json.loads(run_cli("status", job.job_id, env=env).stdout)
    assert found["status"] == "queued" and found["store"] == url
    unknown = run_cli("status", "no-such-job", env=env)
    assert unknown.returncode == 1
    assert url in json.loads(unknown.stdout)["error"]["message"], unknown.stdout


def test_default_store_does_not_depend_on_the_current_folder(
    tmp_path: Path, monkeypatch: Any
) -> None:
    from executor.settings import load_settings

    monkeypatch.delenv("STUDIO_DATA_DIR", raising=False)
    monkeypatch.delenv("STUDIO_DATABASE_URL", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    urls = set()
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        monkeypatch.chdir(tmp_path / folder)
        urls.add(load_settings().sqlalchemy_url)
    assert len(urls) == 1, urls
    expected = "/var/lib/studio-code" if __import__("os").getuid() == 0 else str(tmp_path / "xdg")
    assert urls.pop().startswith(f"sqlite:///{expected}")
    monkeypatch.setenv("STUDIO_DATA_DIR", str(tmp_path / "mine"))
    assert load_settings().sqlalchemy_url == f"sqlite:///{tmp_path / 'mine' / 'studio-code.db'}"


# --- bad rows end cleanly; the HTTP side --------------------------------------------------------


def test_an_unreadable_row_fails_cleanly_and_get_answers_200(
    redis_server: Any, tmp_path: Path, make_settings: Any, procs: list[Service]
) -> None:
    from sqlalchemy import text

    from executor.models import CodeJob
    from executor.store import open_store
    from worker.protocol import TASK_NAME, job_headers

    db = sqlite(tmp_path, "s")
    env = env_for(redis_server.url, db)
    w = start_worker(env, tmp_path / "w.log", name="rows")
    procs.append(w)
    api = ApiServer(env, tmp_path / "api.log")
    procs.append(api)
    base = api.base
    h = {USER: "ann"}
    with client_for(make_settings, redis_server.url, db) as client:
        assert f"run store: {db}" in api.output()
        # readiness and meta show who serves
        ready = httpx.get(f"{base}/healthz/ready", timeout=30).json()
        assert ready["ok"] and ready["workers"]["code.run"]["serving"] == 1, ready
        meta = httpx.get(f"{base}/api/meta/runtime", timeout=30).json()
        assert meta["workers"]["code.test"]["serving"] == 1
        assert meta["store"] == {"url": db, "id": client.store.store_id}

        # a language this worker does not know, and a corrupted JSON column
        job = CodeJob(code=TRIVIAL, user="ann")
        with open_store(db) as store:
            store.create(job, code_runtime="subprocess")
            engine = store.engine  # type: ignore[attr-defined]
            with engine.begin() as conn:
                conn.execute(
                    text(
                        "UPDATE code_jobs SET language = 'cobol', warnings = '[oops' "
                        "WHERE job_id = :j"
                    ),
                    {"j": job.job_id},
                )
            headers = job_headers(store.store_id, store.describe())
        client.app.send_task(
            TASK_NAME,
            args=(job.job_id,),
            task_id=job.job_id,
            queue="code.run",
            ignore_result=True,
            headers=headers,
        )
        rec = client.wait(job.job_id, 30)
        assert rec.status == "failed" and rec.error, (rec, w.output()[-3000:])
        assert rec.error.code == "RUNTIME_UNAVAILABLE"
        assert "cannot be read" in rec.error.message and "cobol" in rec.error.message
        assert any("language='cobol'" in p for p in rec.problems)
        r = httpx.get(f"{base}/api/runs/{job.job_id}", headers=h, timeout=30)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["status"] == "failed" and "cobol" in body["error"]["message"]

        # a finished row whose trace column is damaged later still reads
        done = client.submit(TRIVIAL, "python", {"n": 1}, user="ann")
        assert client.wait(done, 30).status == "succeeded"
        with open_store(db) as store, store.engine.begin() as conn:  # type: ignore[attr-defined]
            conn.execute(
                text("UPDATE code_jobs SET trace = '{' , status = 'exploded' WHERE job_id = :j"),
                {"j": done},
            )
        r = httpx.get(f"{base}/api/runs/{done}", headers=h, timeout=30)
        assert r.status_code == 200, r.text
        assert "status='exploded'" in r.json()["error"]["message"] or r.json()["output"] == 2

        # POST /api/code/test with no worker on code.test: 503 at once, nothing queued
        assert w.stop(30) == 0
        r = httpx.post(f"{base}/api/code/test", json={"code": TRIVIAL}, headers=h, timeout=30)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "RUNTIME_UNAVAILABLE"
        assert "No worker is serving code.test" in r.json()["error"]["message"]
        # code that does not parse is said first, as always (400 before 503)
        r = httpx.post(
            f"{base}/api/code/test", json={"code": "def main(:\n"}, headers=h, timeout=30
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "CODE_INVALID"
        assert client.store.counts_by_status()["queued"] == 0


# --- an unreachable store ----------------------------------------------------------------------


@pytest.mark.postgres
def test_an_unreachable_store_is_runtime_unavailable_naming_it(
    redis_server: Any,
    tmp_path: Path,
    make_settings: Any,
    pg_schema_url: str,
    procs: list[Service],
) -> None:
    from sqlalchemy.engine import make_url

    from api_client import RuntimeUnavailable
    from executor.errors import StoreUnavailable

    real = make_url(pg_schema_url)
    relay = ClosingRelay(real.port or 5432)
    url = (
        real.set(port=relay.port, password="s3cret")
        .update_query_dict({"connect_timeout": "2"})
        .render_as_string(hide_password=False)
    )
    shown = make_url(url).render_as_string(hide_password=True)
    assert "s3cret" not in shown
    try:
        with client_for(make_settings, redis_server.url, url, queue_require_worker=False) as client:
            job = client.submit(TRIVIAL, "python", {})
            assert client.status(job).status == "queued"
            relay.cut()
            for call in (
                lambda: client.status(job),
                lambda: client.submit(TRIVIAL, "python", {}),
                lambda: client.cancel(job),
            ):
                with pytest.raises(RuntimeUnavailable) as caught:
                    call()
                assert isinstance(caught.value, StoreUnavailable)
                assert caught.value.code == "RUNTIME_UNAVAILABLE"
                assert shown in caught.value.message and "s3cret" not in caught.value.message
            relay.restore()
            assert client.status(job).status == "queued", "back once the store is"

        # the HTTP API: 503 naming the store when it goes down under a running API, and
        # when it is down from the start
        env = env_for(redis_server.url, url)
        api = ApiServer(env, tmp_path / "api.log")
        procs.append(api)
        base = api.base
        h = {USER: "ann"}
        assert httpx.get(f"{base}/api/meta/runtime", timeout=30).json()["store"]["url"] == shown
        relay.cut()
        for route in (f"/api/runs/{job}", f"/api/runs/{uuid.uuid4().hex}"):
            r = httpx.get(f"{base}{route}", headers=h, timeout=30)
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["code"] == "RUNTIME_UNAVAILABLE" and shown in err["message"], err
            assert "s3cret" not in r.text
        api.stop(20)
        api = ApiServer(env, tmp_path / "api2.log")
        procs.append(api)
        base = api.base
        r = httpx.post(f"{base}/api/runs", json={"code": TRIVIAL}, headers=h, timeout=30)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "RUNTIME_UNAVAILABLE"
        assert shown in r.json()["error"]["message"] and "s3cret" not in r.text
    finally:
        relay.cut()


# --- the store's part, on both databases -------------------------------------------------------


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return sqlite(tmp_path, "db")
    return str(request.getfixturevalue("pg_schema_url"))


def test_store_id_queued_rows_and_tolerant_reads(store_url: str, tmp_path: Path) -> None:
    from sqlalchemy import text

    from executor.models import CodeJob
    from executor.store import open_store

    with open_store(store_url) as a:
        first = a.store_id
        assert len(first) == 32
        jobs = [CodeJob(code=TRIVIAL, kind=k) for k in ("run", "test", "run")]
        for job in jobs:
            a.create(job, code_runtime="subprocess")
        assert a.claim(jobs[2].job_id, "w@h:1") is not None
    with open_store(store_url) as b, open_store(sqlite(tmp_path, "other")) as other:
        assert b.store_id == first, "the id is written once, at creation"
        assert other.store_id and other.store_id != first
        assert b.list_queued(60) == []
        time.sleep(0.05)
        queued = b.list_queued(0.01)
        assert [q.job_id for q in queued] == [jobs[0].job_id, jobs[1].job_id]
        assert [q.job_id for q in b.list_queued(0.01, kind="test")] == [jobs[1].job_id]
        # only rows still queued change: the running one is left alone
        changed = b.fail_queued([j.job_id for j in jobs], "No worker took it.")
        assert changed == sorted([jobs[0].job_id, jobs[1].job_id])
        assert b.fail_queued([jobs[0].job_id], "again") == []
        rec = b.get(jobs[0].job_id)
        assert rec and rec.status == "failed" and rec.error
        assert rec.error.message == "No worker took it." and rec.finished_at
        assert b.get(jobs[2].job_id).status == "running"  # type: ignore[union-attr]

        # one bad column is a named problem, never an exception
        with b.engine.begin() as conn:  # type: ignore[attr-defined]
            conn.execute(
                text(
                    "UPDATE code_jobs SET language = 'ruby', output = '{no', "
                    "error = NULL WHERE job_id = :j"
                ),
                {"j": jobs[1].job_id},
            )
        bad = b.get(jobs[1].job_id)
        assert bad is not None and bad.status == "failed"
        assert bad.problems == [
            "language='ruby' is not a language this worker knows (python, typescript)",
            "output='{no' is not JSON",
        ]
        assert bad.error and "cannot be read" in bad.error.message
        assert b.get_many([jobs[1].job_id])[jobs[1].job_id].problems == bad.problems
    # read-only opening creates nothing
    missing = tmp_path / "none" / "studio-code.db"
    from executor.errors import StoreUnavailable

    with pytest.raises(StoreUnavailable, match="no such file"):
        open_store(f"sqlite:///{missing}", create=False)
    assert not missing.parent.exists()


@pytest.mark.postgres
def test_jobs_consumed_while_the_store_was_down_are_sent_again(
    redis_server: Any,
    tmp_path: Path,
    make_settings: Any,
    pg_schema_url: str,
    procs: list[Service],
) -> None:
    """The worker's store goes away (the API's does not): the worker takes the messages,
    cannot claim them, and they are gone from Redis. Once the store is back, the queued
    sweep finds rows with no message and sends them again; each job runs exactly once."""
    from sqlalchemy.engine import make_url

    from worker.upkeep.queued import broker_job_ids

    real = make_url(pg_schema_url)
    relay = ClosingRelay(real.port or 5432)
    worker_url = (
        real.set(port=relay.port)
        .update_query_dict({"connect_timeout": "2"})
        .render_as_string(hide_password=False)
    )
    try:
        env = env_for(redis_server.url, worker_url, STUDIO_QUEUE_LOST_AFTER_S="2")
        w = start_worker(env, tmp_path / "w.log", name="outage", concurrency=2)
        procs.append(w)
        with client_for(make_settings, redis_server.url, pg_schema_url) as client:
            assert client.wait(client.submit(TRIVIAL, "python", {"n": 1}), 30).output == 2
            relay.cut()
            jobs = {client.submit(TRIVIAL, "python", {"n": i}): i for i in range(8)}
            time.sleep(3)
            assert all(client.status(j).status == "queued" for j in jobs)
            # A worker that pauses while its store is down leaves the messages in Redis;
            # one that took them and failed to claim lost them: the sweep must re-send.
            # (a run still on its user's fair-share list is not lost: it was never sent)
            lost = set(jobs) - (broker_job_ids(client.redis, list(jobs)) or set())
            relay.restore()
            t0 = time.monotonic()
            recs = {j: client.wait(j, 60) for j in jobs}
            print(
                f"\n8 jobs consumed during the outage ended {time.monotonic() - t0:.1f} s "
                "after the store came back"
            )
            assert {j: (r.status, r.output, r.attempts) for j, r in recs.items()} == {
                j: ("succeeded", 2 * i, 1) for j, i in jobs.items()
            }, w.output()[-3000:]
            print(f"messages lost during the outage: {len(lost)}")
            if lost:
                assert "sent again" in w.output()
    finally:
        relay.cut()
