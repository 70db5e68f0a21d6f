"""A node's retry policy (executor.retry, worker.job.retries, worker.upkeep.retry_due): which
outcomes may be retried (a closed list, refused at every door), the next attempt held in the
run store (running -> queued with a not-before time, claim refuses it early, a sweep sends it
when due, exactly once), a CODE_MEMORY retry with more memory, every attempt in the run's
history, a worker SIGKILLed during the delay losing nothing and a cancel during the delay
ending the run. The store form on SQLite and PostgreSQL; end to end with a real API, worker,
Redis, engine and store (testkit Stack)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from testkit.processes import wait_for
from testkit.stack import DOCKER_PYTHON, Stack
from tests.snippets import OK_CODE, RAISE_CODE

# --- the policy: what may be asked -----------------------------------------------------------


def test_the_policy_is_a_closed_list_with_bounds() -> None:
    from executor.errors import CodeInvalid, ErrorCode
    from executor.retry import delay_s, more_memory, parse_policy

    p = parse_policy({"max_attempts": 3, "on": ["CODE_ERROR", "CODE_MEMORY"]})
    assert p is not None and p.on == (ErrorCode.CODE_ERROR, ErrorCode.CODE_MEMORY)
    assert parse_policy(None) is None and parse_policy("") is None
    # the default names the two outcomes that are not deterministic, never CODE_ERROR
    assert ErrorCode.CODE_ERROR not in parse_policy({}).on  # type: ignore[union-attr]
    for never in (
        "CODE_INVALID",
        "CODE_CANCELLED",
        "CODE_OUTPUT_INVALID",
        "CODE_NODES_DISABLED",
        "RATE_LIMITED",
        "RUNTIME_UNAVAILABLE",
    ):
        with pytest.raises(CodeInvalid) as refused:
            parse_policy({"on": [never]})
        assert never in refused.value.message
        assert "CODE_TIMEOUT, CODE_MEMORY, CODE_ERROR" in refused.value.message
    for bad in (
        {"max_attempts": 11},
        {"max_attempts": 0},
        {"backoff": {"initial_s": 3601}},
        {"backoff": {"max_s": -1}},
        {"backoff": {"factor": 0.5}},
        {"backoff": {"jitter": 2}},
        {"unknown": 1},
        "not json",
        [1],
    ):
        with pytest.raises(CodeInvalid):
            parse_policy(bad)
    exact = parse_policy({"backoff": {"initial_s": 1, "factor": 3, "max_s": 5, "jitter": 0}})
    assert [delay_s(exact, n) for n in (1, 2, 3)] == [1, 3, 5]  # type: ignore[arg-type]
    mb = 2**20
    # max(2 x limit, 1.5 x peak), at most the cap, never below the limit
    assert more_memory(128 * mb, 128 * mb, 1024 * mb) == 256 * mb
    assert more_memory(128 * mb, 300 * mb, 1024 * mb) == 450 * mb
    assert more_memory(128 * mb, None, 200 * mb) == 200 * mb
    assert more_memory(256 * mb, 256 * mb, 256 * mb) == 256 * mb


def test_why_it_waits_names_the_retry_delay() -> None:
    """``explain`` (api_client.why_waiting) with a live worker: a run waiting out its delay,
    or due and not sent yet, is ``retry_delay``; once sent, its place in its queue."""
    from api_client.why_waiting import explain
    from worker.registry import WorkerInfo

    live = [WorkerInfo(nodename="w@h", queue="code.run", slots=1)]

    def why(**retry: Any) -> Any:
        return explain(
            queue="code.run",
            job_id="j",
            infos=live,
            store_id="",
            fair=None,
            position=lambda: 0,
            done_lately=lambda: 0,
            now_ts=1000.0,
            **retry,
        )

    held = why(not_before_ts=1012.5)
    assert (held.held_by, held.estimate_s) == ("retry_delay", 12.5)
    assert held.not_before is not None and held.not_before.timestamp() == 1012.5
    assert "in 12.5 s" in held.reason
    due = why(not_before_ts=999.0)
    assert due.held_by == "retry_delay" and "STUDIO_QUEUE_RETRY_TICK_S" in due.reason
    assert why(not_before_ts=999.0, retry_sent=True).held_by == "queue"
    assert why().held_by == "queue"


# --- the store form: SQLite and PostgreSQL ---------------------------------------------------


def test_the_next_attempt_is_held_in_the_store(store_url: str) -> None:
    from executor.models import Attempt, CodeJob, CodeResult, RetryPolicy, Status
    from executor.store import open_store

    with open_store(store_url) as store:
        job = CodeJob(code=OK_CODE, retry=RetryPolicy(max_attempts=3))
        store.create(job, code_runtime="docker")
        rec = store.claim(job.job_id, "w1")
        assert rec is not None and rec.retry == job.retry and rec.claims == 1
        first = Attempt(attempt=1, status="failed", code="CODE_MEMORY", memory_bytes=1)
        due = time.time() + 1.5
        # only the worker holding the claim queues the next attempt, once
        assert not store.retry(job.job_id, "w2", history=[first], not_before_ts=due, memory_bytes=2)
        assert store.retry(job.job_id, "w1", history=[first], not_before_ts=due, memory_bytes=2)
        assert not store.retry(job.job_id, "w1", history=[first], not_before_ts=due, memory_bytes=2)
        rec = store.get(job.job_id)
        assert rec.status is Status.QUEUED and rec.history == [first] and rec.memory_bytes == 2
        assert rec.claims == 0 and rec.attempts == 1  # a code attempt leaves the infra budget
        # held: not claimed, not due, not "lost" to the lost-message sweep
        assert store.claim(job.job_id, "w3") is None
        assert store.due_retries() == [] and store.list_queued(0) == []
        wait_for(lambda: store.due_retries(), 10, "the attempt due")
        # due: the retry sweep's to send, not the lost-message sweep's (never both)
        assert store.list_queued(0) == []
        # one sweep sends it; then, should its message be lost, the lost-message sweep's
        assert store.mark_retry_sent(job.job_id) and not store.mark_retry_sent(job.job_id)
        assert store.due_retries() == []
        assert [q.job_id for q in store.list_queued(0)] == [job.job_id]
        rec = store.claim(job.job_id, "w3")
        assert rec is not None and rec.claims == 1 and rec.code_attempt == 2
        second = Attempt(attempt=2, status="succeeded")
        done = CodeResult(
            job_id=job.job_id,
            language="python",
            status=Status.SUCCEEDED,
            runtime="docker",
            code_runtime="docker",
            history=[first, second],
        )
        assert store.finish(done, worker="w3")
        assert store.get(job.job_id).history == [first, second]
        # a cancel during a delay ends the run cancelled: its attempt is never claimed
        other = CodeJob(code=OK_CODE, retry=RetryPolicy())
        store.create(other, code_runtime="docker")
        store.claim(other.job_id, "w1")
        store.retry(other.job_id, "w1", history=[first], not_before_ts=0.0, memory_bytes=None)
        assert store.request_cancel(other.job_id) is Status.CANCELLED
        assert store.due_retries() == [] and store.claim(other.job_id, "w1") is None
        # a cancel while it runs: no retry (the worker's finish ends it cancelled)
        third = CodeJob(code=OK_CODE, retry=RetryPolicy())
        store.create(third, code_runtime="docker")
        store.claim(third.job_id, "w1")
        assert store.request_cancel(third.job_id) is Status.CANCELLING
        assert not store.retry(third.job_id, "w1", history=[], not_before_ts=0, memory_bytes=None)


# --- end to end -----------------------------------------------------------------------------

MB = 2**20
#: allocates (and touches) 150 MB, then reports the memory limit it ran under, read from
#: inside its sandbox: over 128m it is killed, under 256m it passes
GROW = (
    "def main(state):\n"
    "    b = bytearray(150_000_000)\n"
    "    b[::4096] = b'x' * len(b[::4096])\n"
    "    for p in ('/sys/fs/cgroup/memory.max', '/sys/fs/cgroup/memory/memory.limit_in_bytes'):\n"
    "        try:\n"
    "            return {'limit': int(open(p).read().strip())}\n"
    "        except (OSError, ValueError):\n"
    "            pass\n"
    "    return {'limit': None}\n"
)


def _fast(**policy: Any) -> dict[str, Any]:
    return {"backoff": {"initial_s": 0.2, "jitter": 0}, **policy}


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, docker_client: Any, python_image: str
) -> Iterator[Stack]:
    with Stack(
        tmp_path_factory.mktemp("retry"),
        **DOCKER_PYTHON,
        code_image=python_image,
        code_max_memory="512m",
        queue_retry_tick_s=0.2,
    ) as s:
        s.start_worker("worker")
        s.start_api()
        yield s


def _user() -> str:
    return f"u-{uuid.uuid4().hex[:8]}"


def _post(stack: Stack, user: str, code: str, retry: Any, **body: Any) -> str:
    r = stack.http.post(
        "/api/runs", json={"code": code, "retry": retry, **body}, headers=stack.as_user(user)
    )
    assert r.status_code == 202, r.text
    return str(r.json()["job_id"])


@pytest.mark.docker
@pytest.mark.redis
def test_a_node_out_of_memory_once_passes_with_more_memory(stack: Stack) -> None:
    user = _user()
    job_id = _post(stack, user, GROW, _fast(on=["CODE_MEMORY"]), memory="128m")
    done = stack.until(job_id, user, timeout=90)
    assert done["status"] == "succeeded", done
    # the second attempt ran under twice the memory: its sandbox says so from inside
    assert done["output"] == {"limit": 256 * MB}, done
    first, second = done["history"]
    assert (first["attempt"], first["code"]) == (1, "CODE_MEMORY")
    assert first["memory_bytes"] == 128 * MB and first["next_memory_bytes"] == 256 * MB
    assert first["usage"]["memory_peak_bytes"] > 100 * MB
    assert (second["attempt"], second["status"]) == (2, "succeeded")
    assert second["memory_bytes"] == 256 * MB
    assert done["memory_bytes"] == 256 * MB and done["attempts"] == 2
    assert any("asked for 256 MiB" in w for w in done["warnings"]), done["warnings"]
    assert [t["step"] for t in done["trace"]].count("attempt") == 1


@pytest.mark.docker
@pytest.mark.redis
def test_code_error_is_retried_only_when_asked(stack: Stack) -> None:
    user = _user()
    plain = _post(stack, user, RAISE_CODE, _fast(max_attempts=3))  # on: timeout, memory
    asked = _post(stack, user, RAISE_CODE, _fast(max_attempts=3, on=["CODE_ERROR"]))
    once = stack.until(plain, user, timeout=60)
    assert once["status"] == "failed" and once["error"]["code"] == "CODE_ERROR", once
    assert [a["code"] for a in once["history"]] == ["CODE_ERROR"] and once["attempts"] == 1
    thrice = stack.until(asked, user, timeout=60)
    assert thrice["status"] == "failed" and thrice["error"]["code"] == "CODE_ERROR", thrice
    assert [a["attempt"] for a in thrice["history"]] == [1, 2, 3]
    assert [a["code"] for a in thrice["history"]] == ["CODE_ERROR"] * 3
    assert thrice["attempts"] == 3
    # an outcome never retried, or a bound passed: refused at submit, nothing queued
    for bad in ({"on": ["CODE_INVALID"]}, {"on": ["RATE_LIMITED"]}, {"max_attempts": 11}):
        r = stack.http.post(
            "/api/runs",
            json={"code": OK_CODE, "retry": bad},
            headers=stack.as_user(user),
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "CODE_INVALID", r.text


def _held(stack: Stack, job_id: str, user: str) -> dict[str, Any]:
    """The run once it waits out its retry delay, as GET /api/runs/{id} says it."""
    body = stack.until(job_id, user, statuses={"queued"}, timeout=60)
    while not body.get("history"):
        time.sleep(0.05)
        body = stack.run(job_id, user)
    return body


@pytest.mark.docker
@pytest.mark.redis
def test_a_worker_killed_during_the_delay_loses_nothing(stack: Stack) -> None:
    user = _user()
    policy = {"max_attempts": 2, "on": ["CODE_ERROR"], "backoff": {"initial_s": 3, "jitter": 0}}
    job_id = _post(stack, user, RAISE_CODE, policy)
    held = _held(stack, job_id, user)
    assert held["waiting"]["held_by"] == "retry_delay", held["waiting"]
    assert held["waiting"]["not_before"] is not None and "retry" in held["waiting"]["reason"]
    # the only worker dies in the delay; another starts: the attempt still runs, once
    killed = stack.workers[-1]
    killed.kill_hard()
    stack.start_worker("after-kill")
    done = stack.until(job_id, user, timeout=60)
    assert done["status"] == "failed", done
    assert [a["attempt"] for a in done["history"]] == [1, 2], done["history"]
    assert done["attempts"] == 2  # two claims in all: the second attempt ran once
    assert done["worker"].startswith("after-kill@")


@pytest.mark.docker
@pytest.mark.redis
def test_a_cancel_during_the_delay_ends_the_run(stack: Stack) -> None:
    user = _user()
    policy = {"max_attempts": 2, "on": ["CODE_ERROR"], "backoff": {"initial_s": 1.5, "jitter": 0}}
    job_id = _post(stack, user, RAISE_CODE, policy)
    _held(stack, job_id, user)
    r = stack.http.post(f"/api/runs/{job_id}/cancel", headers=stack.as_user(user))
    assert r.status_code == 202, r.text
    assert r.json()["status"] == "cancelled", r.text
    time.sleep(2.5)  # past its due time and a few sweeps: nothing runs it
    done = stack.run(job_id, user)
    assert done["status"] == "cancelled" and done["error"]["code"] == "CODE_CANCELLED", done
    assert len(done["history"]) == 1 and done["attempts"] == 1, done


#: takes a moment (the store is stopped meanwhile), then raises
SLOW_RAISE = (
    "import time\n\n"
    "def main(state):\n"
    "    time.sleep(state['s'])\n"
    "    raise ValueError('boom after a moment')\n"
)


@pytest.mark.redis
@pytest.mark.postgres
@pytest.mark.timeout(240)
def test_a_retry_the_store_could_not_take_is_run_again_not_lost(tmp_path: Any) -> None:
    """The run store (a PostgreSQL cluster of the test's own) stops while an attempt runs;
    the attempt ends CODE_ERROR, which its policy retries, and its next attempt cannot be
    written. The message goes back to its queue (an infrastructure re-run, the attempt's
    outcome never recorded), never acknowledged: once the store is back the attempt runs
    again, then its retry: the run ends failed CODE_ERROR with both code attempts in its
    history and the re-run counted apart in ``attempts``. (Acknowledged, as before, the run
    stayed ``running`` without a message until the reaper ended it failed
    RUNTIME_UNAVAILABLE: the soak with --retries found it.)"""
    from testkit.postgres import start_pg_cluster

    with (
        start_pg_cluster() as pg,
        Stack(
            tmp_path,
            database_url=pg.url,
            code_runtime="subprocess",
            code_languages="python",
            code_max_seconds=30,
            queue_retry_tick_s=0.2,
            queue_reap_interval_s=1,
        ) as q,
    ):
        w = q.start_worker("w", 1)
        policy = {"max_attempts": 2, "on": ["CODE_ERROR"], "backoff": {"initial_s": 0.2}}
        job = q.client.submit(SLOW_RAISE, "python", {"s": 4}, user="ann", retry=policy)
        wait_for(lambda: q.client.store.get(job, inputs=False).status == "running", 60, "running")
        pg.stop()
        try:
            # the attempt ends while the store is down: handed back (or, before, acknowledged)
            wait_for(
                lambda: (
                    "next attempt waits for the run store" in w.output()
                    or "raised unexpected" in w.output()
                ),
                60,
                "the attempt's end",
            )
        finally:
            pg.start()
        rec = q.client.wait(job, 120)
        assert rec.status == "failed", (rec.status, rec.error, w.output()[-3000:])
        assert rec.error is not None and rec.error.code == "CODE_ERROR", rec.error
        assert [(a.attempt, a.code) for a in rec.history] == [
            (1, "CODE_ERROR"),
            (2, "CODE_ERROR"),
        ], rec.history
        # its claims: the attempt handed back, its re-run, the retry
        assert rec.attempts == 3, rec.attempts
        assert "its next attempt waits for the run store" in w.output()
