"""Idempotent submits (api_client.idempotency): a submit that carries a key and is repeated —
because the caller crashed, timed out or retried — gets the first job, never a second row,
message or run. Proved on the run store of both databases (the unique key under 20 racing
writers of their own connections) and end to end: a real API, worker, Redis and PostgreSQL,
a calling process SIGKILLed between its submit and its own record of the answer."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from testkit.postgres import POSTGRES_URL, pg_schema, pg_unreachable
from testkit.processes import require
from testkit.stack import DOCKER_PYTHON, Stack
from tests.conftest import run_cli
from tests.snippets import OK_CODE

# --- the run store: the key's row and the job's, one transaction ---------------------------


def _job(user: str = "u1", n: int = 1) -> Any:
    from executor.models import CodeJob

    return CodeJob(code=OK_CODE, state_json=f'{{"n": {n}}}', user=user)


def _keyed(store: Any, job: Any, key: str, expires_at: datetime | None = None) -> Any:
    from api_client.idempotency import Keyed

    k = Keyed.of(job, key, 3600)
    return store.create_keyed(
        job,
        code_runtime="docker",
        key_hash=k.key_hash,
        request_hash=k.request_hash,
        expires_at=expires_at or k.expires_at,
    )


def test_a_key_names_its_first_job_until_it_expires(store_url: str) -> None:
    from api_client.idempotency import IdempotencyConflict, Keyed, key_hash
    from executor.store import open_store

    with open_store(store_url) as store:
        first = _job()
        made = _keyed(store, first, "k-1")
        assert made.created and made.job_id == first.job_id
        # the same key again (a new job object: a repeat is a new request of the same
        # content) makes nothing and names the first
        again = _keyed(store, _job(), "k-1")
        assert (again.created, again.job_id) == (False, first.job_id)
        assert store.find_key("u1", key_hash("k-1")).job_id == first.job_id
        # the key is the user's: another user's same key is another job
        other = _keyed(store, _job(user="u2"), "k-1")
        assert other.created and other.job_id != first.job_id
        # another request under the key: refused, naming the first job
        with pytest.raises(IdempotencyConflict) as refused:
            Keyed.of(_job(n=2), "k-1", 3600).first_job(again)
        assert refused.value.job_id == first.job_id and first.job_id in refused.value.message
        # an expired key is free again: the next submit under it is a new job
        stale = _keyed(store, _job(), "k-2", datetime.now(UTC) - timedelta(seconds=1))
        assert stale.created and store.find_key("u1", key_hash("k-2")) is None
        renewed = _keyed(store, _job(), "k-2")
        assert renewed.created and renewed.job_id != stale.job_id
        # retention removes the expired keys only
        report = store.prune(runs_before=None, payloads_before=None, keys_before=datetime.now(UTC))
        assert report.keys_removed == 0  # k-2's expired row was replaced by renewed
        _keyed(store, _job(), "k-3", datetime.now(UTC) - timedelta(seconds=1))
        report = store.prune(runs_before=None, payloads_before=None, keys_before=datetime.now(UTC))
        assert report.keys_removed == 1
        assert store.find_key("u1", key_hash("k-1")) is not None
        # what the table holds of a key is its digest only
        from sqlalchemy import select

        from executor.store.schema import idempotency

        with store.engine.connect() as conn:
            rows = [tuple(map(str, r)) for r in conn.execute(select(idempotency))]
        assert rows and not any("k-1" in cell or "k-2" in cell for r in rows for cell in r)


def test_a_key_whose_job_retention_removed_is_free_again(store_url: str) -> None:
    from api_client.idempotency import key_hash
    from executor.store import open_store
    from executor.store.schema import jobs

    with open_store(store_url) as store:
        made = _keyed(store, _job(), "gone")
        with store.engine.begin() as conn:
            conn.execute(jobs.delete().where(jobs.c.job_id == made.job_id))
        assert store.find_key("u1", key_hash("gone")) is None
        again = _keyed(store, _job(), "gone")
        assert again.created and again.job_id != made.job_id


def test_twenty_racing_repeats_make_one_job(store_url: str) -> None:
    """20 writers, each on its own store (its own connections), insert under one key at
    once: one job is made, every writer is told that job, and the store holds one row."""
    from executor.store import RunFilter, open_store

    open_store(store_url).close()  # the schema made once, before the race
    stores = [open_store(store_url) for _ in range(20)]
    barrier = threading.Barrier(len(stores))

    def repeat(store: Any) -> Any:
        job = _job(user="racer")
        barrier.wait()
        return _keyed(store, job, "same-key")

    try:
        with concurrent.futures.ThreadPoolExecutor(len(stores)) as pool:
            got = list(pool.map(repeat, stores))
        assert sum(g.created for g in got) == 1, got
        assert len({g.job_id for g in got}) == 1, got
        runs = stores[0].list_runs(RunFilter(user="racer"), limit=100)
        assert [r.job_id for r in runs] == [got[0].job_id]
    finally:
        for s in stores:
            s.close()


# --- end to end: the API, a worker, Redis, PostgreSQL ---------------------------------------


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, docker_client: Any, python_image: str
) -> Iterator[Stack]:
    why = pg_unreachable(POSTGRES_URL)
    require(why is None, str(why))
    with (
        pg_schema(POSTGRES_URL, prefix="idem") as url,
        Stack(
            tmp_path_factory.mktemp("idem"),
            database_url=url,
            **DOCKER_PYTHON,
            code_image=python_image,
            code_test_per_minute=2,
        ) as s,
    ):
        s.start_worker("worker")
        s.start_api()
        yield s


def _user() -> str:
    return f"u-{uuid.uuid4().hex[:8]}"


def _runs_of(stack: Stack, user: str) -> list[str]:
    from executor.store import RunFilter

    return [r.job_id for r in stack.client.store.list_runs(RunFilter(user=user), limit=100)]


#: a caller that sends one keyed POST /api/runs and, once the request is on the wire, says
#: so and waits to be killed: it never reads, let alone records, the answer
_CALLER = r"""
import json, socket, sys
host, port, user, key = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
body = json.dumps({"code": sys.stdin.read(), "state": {"n": 21}}).encode()
head = (
    f"POST /api/runs HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
    f"Content-Length: {len(body)}\r\nX-Studio-User: {user}\r\nIdempotency-Key: {key}\r\n\r\n"
).encode()
s = socket.create_connection((host, port))
s.sendall(head + body)
print("sent", flush=True)
sys.stdin.close()
import time
time.sleep(600)
"""


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.postgres
def test_a_caller_killed_after_its_submit_gets_its_one_run_back_with_the_key(
    stack: Stack,
) -> None:
    from urllib.parse import urlparse

    user, key = _user(), str(uuid.uuid4())
    where = urlparse(stack.base)
    caller = subprocess.Popen(
        [sys.executable, "-c", _CALLER, str(where.hostname), str(where.port), user, key],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert caller.stdin is not None and caller.stdout is not None
    caller.stdin.write(OK_CODE)
    caller.stdin.close()
    assert caller.stdout.readline().strip() == "sent"
    os.kill(caller.pid, signal.SIGKILL)  # before it read a byte of the answer
    caller.wait(10)
    # the caller's successor repeats the submit with the same key (maybe while the first is
    # still being stored: the key's unique row decides)
    h = {**stack.as_user(user), "Idempotency-Key": key}
    r = stack.http.post("/api/runs", json={"code": OK_CODE, "state": {"n": 21}}, headers=h)
    assert r.status_code == 202, r.text
    job_id = r.json()["job_id"]
    done = stack.until(job_id, user, timeout=90)
    assert done["status"] == "succeeded" and done["output"] == {"double": 42}, done
    # and again once it ended: the same run, as it is now
    r = stack.http.post("/api/runs", json={"code": OK_CODE, "state": {"n": 21}}, headers=h)
    assert r.status_code == 202 and r.json()["job_id"] == job_id, r.text
    assert r.json()["status"] == "succeeded"
    # one row, one run
    assert _runs_of(stack, user) == [job_id]
    rec = stack.client.store.get(job_id)
    assert rec.attempts == 1, rec
    assert stack.done_count(job_id) <= 1


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.postgres
def test_twenty_concurrent_repeats_over_http_are_one_run(stack: Stack) -> None:
    user, key = _user(), str(uuid.uuid4())
    h = {**stack.as_user(user), "Idempotency-Key": key}
    barrier = threading.Barrier(20)

    def submit(_: int) -> Any:
        barrier.wait()
        return stack.http.post("/api/runs", json={"code": OK_CODE, "state": {"n": 1}}, headers=h)

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(submit, range(20)))
    assert [a.status_code for a in answers] == [202] * 20, [a.text for a in answers][:2]
    ids = {a.json()["job_id"] for a in answers}
    assert len(ids) == 1, ids
    (job_id,) = ids
    assert _runs_of(stack, user) == [job_id]
    assert stack.until(job_id, user, timeout=90)["status"] == "succeeded"
    assert stack.client.store.get(job_id).attempts == 1


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.postgres
def test_the_same_key_with_another_request_is_409_naming_the_first(stack: Stack) -> None:
    user, key = _user(), "order-7:retry"
    h = {**stack.as_user(user), "Idempotency-Key": key}
    r = stack.http.post("/api/runs", json={"code": OK_CODE, "state": {"n": 1}}, headers=h)
    assert r.status_code == 202, r.text
    first = r.json()["job_id"]
    r = stack.http.post("/api/runs", json={"code": OK_CODE, "state": {"n": 2}}, headers=h)
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["code"] == "IDEMPOTENCY_CONFLICT" and err["job_id"] == first
    assert first in err["message"]
    # the concurrency keys are part of the request: the same body under another workflow
    # (or tenant) is another request
    for keys in ({"workflow": "wf-other"}, {"tenant": "t-other"}):
        r = stack.http.post(
            "/api/runs", json={"code": OK_CODE, "state": {"n": 1}, **keys}, headers=h
        )
        assert r.status_code == 409, (keys, r.text)
        assert r.json()["error"]["job_id"] == first
    # the state is compared as JSON: the same object with its keys in another order is the
    # same request
    r = stack.http.post(
        "/api/runs",
        content=b'{"state": {"n": 1}, "code": ' + json.dumps(OK_CODE).encode() + b"}",
        headers={**h, "Content-Type": "application/json"},
    )
    assert r.status_code == 202 and r.json()["job_id"] == first, r.text
    # the key is the caller's: another user's same key is its own run
    other = _user()
    r = stack.http.post(
        "/api/runs",
        json={"code": OK_CODE, "state": {"n": 1}},
        headers={**stack.as_user(other), "Idempotency-Key": key},
    )
    assert r.status_code == 202 and r.json()["job_id"] != first
    # a key that is not one: 400 saying what a key may be, nothing queued
    bad_user = _user()
    for bad in (b"", b"x" * 256, b"with space", "é".encode()):
        r = stack.http.post(
            "/api/runs",
            json={"code": OK_CODE},
            headers=[*stack.as_user(bad_user).items(), ("Idempotency-Key", bad)],
        )
        assert r.status_code == 400, (bad, r.text)
        error = r.json()["error"]
        assert error["code"] == "CODE_INVALID" and "idempotency key" in error["message"]
    assert _runs_of(stack, bad_user) == []


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.postgres
def test_a_repeated_test_call_answers_its_first_run_outside_the_limit(stack: Stack) -> None:
    """The editor's Test button retried with its key: the first call's result again, not a
    second run, and not counted against STUDIO_CODE_TEST_PER_MINUTE (2 in this stack)."""
    user = _user()
    h = {**stack.as_user(user), "Idempotency-Key": "test-click-1"}
    body = {"code": OK_CODE, "state": {"n": 4}}
    first = stack.http.post("/api/code/test", json=body, headers=h)
    assert first.status_code == 200 and first.json()["output"] == {"double": 8}, first.text
    for _ in range(3):
        again = stack.http.post("/api/code/test", json=body, headers=h)
        assert again.status_code == 200, again.text
        assert again.json()["job_id"] == first.json()["job_id"]
    assert _runs_of(stack, user) == [first.json()["job_id"]]
    # the count saw one call: one more unkeyed call fits, the next is refused
    plain = stack.as_user(user)
    assert stack.http.post("/api/code/test", json=body, headers=plain).status_code == 200
    assert stack.http.post("/api/code/test", json=body, headers=plain).status_code == 429


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.postgres
def test_the_cli_submit_takes_a_key(stack: Stack, tmp_path: Any) -> None:
    node = tmp_path / "node.py"
    node.write_text(OK_CODE)
    user, key = _user(), str(uuid.uuid4())
    env = stack.env()
    args = ("submit", str(node), "--state", '{"n": 3}', "--user", user, "--idempotency-key", key)
    ids = []
    for _ in range(2):
        done = run_cli(*args, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        ids.append(json.loads(done.stdout)["job_id"])
    assert ids[0] == ids[1] and _runs_of(stack, user) == [ids[0]]
    refused = run_cli(*args[:3], '{"n": 4}', *args[4:], env=env)
    out = json.loads(refused.stdout)
    assert refused.returncode == 1 and out["error"]["code"] == "CODE_INVALID"
    assert out["job_id"] == ids[0]
