"""The sync/async twins decide alike: the same input, on a real redis-server of the module's
own and a real SQLite run store, gives the same outcome through the sync driver and the
asyncio one (``CodeClient.wait`` / ``wait_async``, ``follow`` / ``follow_async``,
``WorkerRegistry`` / ``AsyncWorkerRegistry``, ``_check_served`` / ``check_served_async``).
No worker runs: the jobs are rows and Redis keys the test writes as a worker would."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest
import redis

from api_client.client import CodeClient, JobNotFound
from api_client.log_follower import LogEvent, follow, follow_async
from executor.errors import ErrorCode, RuntimeUnavailable
from executor.models import Status
from testkit.redis import RedisServer, start_redis
from worker.protocol import (
    QUEUE_RUN,
    QUEUE_TEST,
    done_key,
    in_flight_key,
    leave_notice,
    logs_key,
    rate_key,
)
from worker.registry import AsyncWorkerRegistry, WorkerRegistry
from worker.upkeep.heartbeat import Heartbeat

#: this module's own redis-server (its command counts are the test's alone)
SERVICE_FIXTURES = {"own_redis": ("redis",)}

T = TypeVar("T")


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with start_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def client(own_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from executor.settings import load_settings

    data = tmp_path_factory.mktemp("store")
    settings = load_settings(
        enable_code_nodes=True,
        data_dir=data,
        redis_url=own_redis.url,
        database_url=f"sqlite:///{data / 'runs.db'}",
        queue_require_worker=False,
    )
    with CodeClient(settings) as c:
        yield c


def on_loop(client: Any, make: Callable[[], Awaitable[T]]) -> T:
    """``make()`` awaited on a fresh event loop, the client's redis.asyncio side closed
    after it (as the API's lifespan does)."""

    async def run() -> T:
        try:
            return await make()
        finally:
            await client.aclose()

    return asyncio.run(run())


def queued(client: Any) -> str:
    """A job queued in the store with no message sent (no worker would take it)."""
    job = client.prepare("def main(state):\n    return 1\n", "python", {}, kind="run")
    client.store.create(job, code_runtime=client.settings.code_runtime)
    return str(job.job_id)


def blmoves(server: RedisServer) -> int:
    stats = redis.Redis.from_url(server.url).info("commandstats")
    return int(stats.get("cmdstat_blmove", {}).get("calls", 0))


# --- wait / wait_async -----------------------------------------------------------------


def test_wait_settles_a_job_another_store_received_on_its_first_read(
    client: Any, own_redis: RedisServer
) -> None:
    """A job a worker on ANOTHER run store received (its notice in Redis) ends failed with
    the notice's message on the wait's first read, sync and async alike: no BLMOVE is
    needed to answer it (wait_async used to block on the done notice until its first
    settle, 5 s in, while wait answered at once)."""
    message = "No job of this id in the worker's run store (another store): give both ..."
    jobs = [queued(client), queued(client)]
    for job_id in jobs:
        leave_notice(client.redis, job_id, ErrorCode.RUNTIME_UNAVAILABLE.value, message)
    before = blmoves(own_redis)
    sync = client.wait(jobs[0], 30)
    asynced = on_loop(client, lambda: client.wait_async(jobs[1], 30))
    assert blmoves(own_redis) == before, "a wait blocked on the notice before settling"
    for rec in (sync, asynced):
        assert rec.status is Status.FAILED
        assert rec.error is not None and rec.error.message == message


def test_wait_answers_from_the_notice_alike(client: Any) -> None:
    """A just-submitted job whose done notice carries its finished record: both drivers
    return that record; an unknown job raises JobNotFound in both."""
    jobs = [queued(client), queued(client)]
    for job_id in jobs:
        rec = client.store.get(job_id, inputs=False)
        done = rec.model_copy(update={"status": Status.SUCCEEDED}).model_dump_json()
        client.redis.rpush(done_key(job_id), done)
    sync = client.wait(jobs[0], 30, submitted=True)
    asynced = on_loop(client, lambda: client.wait_async(jobs[1], 30, submitted=True))
    assert (sync.job_id, sync.status) == (jobs[0], Status.SUCCEEDED)
    assert (asynced.job_id, asynced.status) == (jobs[1], Status.SUCCEEDED)
    missing = uuid.uuid4().hex
    with pytest.raises(JobNotFound):
        client.wait(missing, 5)
    with pytest.raises(JobNotFound):
        on_loop(client, lambda: client.wait_async(missing, 5))


# --- follow / follow_async -------------------------------------------------------------


def test_follow_yields_the_same_events(client: Any) -> None:
    """A finished job's stream (a character split between two entries, then the end):
    both followers yield the same events, then the stored outcome's end."""
    job_id = queued(client)
    job = client.store.get(job_id, inputs=True).to_job()
    client.store.finish(
        client._ended(job, Status.FAILED, ErrorCode.RUNTIME_UNAVAILABLE, "gone"), worker="t"
    )
    client.redis.xadd(logs_key(job_id), {"d": b"caf\xc3"})
    client.redis.xadd(logs_key(job_id), {"d": b"\xa9!\n", "end": b"1"})

    def status() -> Any:
        return client.store.get_summary(job_id)

    def final() -> Any:
        return client.store.get(job_id, inputs=False)

    sync = list(follow(client._blocking, job_id, status, final, timeout_s=30))

    async def collect() -> list[LogEvent]:
        events: AsyncIterator[LogEvent] = follow_async(
            client.async_redis, job_id, status, final, timeout_s=30
        )
        return [e async for e in events]

    asynced = on_loop(client, collect)
    assert [(e.event, e.data) for e in sync] == [
        ("log", "caf"),
        ("log", "é!\n"),
        ("end", '{"status": "failed", "logs_truncated": false}'),
    ]
    assert asynced == sync


def both_follows(
    client: Any,
    redis_sync: Any,
    redis_async: Callable[[], Any],
    job_id: str,
    last_id: str = "0-0",
) -> tuple[list[LogEvent], list[LogEvent], list[str]]:
    """The events of ``follow`` and ``follow_async`` (the given Redis clients: the async one
    made on the loop) and every
    store read they made, in order (``status`` or ``final``); 30 s at most each (a guard
    against a follow that never ends: it ends without an ``end`` then)."""
    reads: list[str] = []

    def status() -> Any:
        reads.append("status")
        return client.store.get_summary(job_id)

    def final() -> Any:
        reads.append("final")
        return client.store.get(job_id, inputs=False)

    sync = list(follow(redis_sync, job_id, status, final, timeout_s=30, last_id=last_id))

    async def collect() -> list[LogEvent]:
        events: AsyncIterator[LogEvent] = follow_async(
            redis_async(), job_id, status, final, timeout_s=30, last_id=last_id
        )
        return [e async for e in events]

    asynced = on_loop(client, collect)
    return sync, asynced, reads


def xreads(server: RedisServer) -> int:
    """XREADs the server took (``calls`` counts the failed ones too)."""
    stats = redis.Redis.from_url(server.url).info("commandstats").get("cmdstat_xread", {})
    return int(stats.get("calls", 0)) + int(stats.get("rejected_calls", 0))


@pytest.mark.parametrize("finished", [False, True], ids=["running", "finished"])
def test_an_id_redis_refuses_ends_the_follow_at_once(
    client: Any, own_redis: RedisServer, finished: bool
) -> None:
    """A Last-Event-ID part over 2^64-1 (the API refuses it first: tests/test_ops_stack.py)
    given to the followers: Redis answers the XREAD with an error, and each follow ends at
    once with an ``end`` naming why: one XREAD and one status read each (the run's record
    too when it has finished), never a retry loop that reads the store for an hour."""
    job_id = queued(client)
    if finished:
        job = client.store.get(job_id, inputs=True).to_job()
        client.store.finish(
            client._ended(job, Status.FAILED, ErrorCode.RUNTIME_UNAVAILABLE, "gone"), worker="t"
        )
    before = xreads(own_redis)
    sync, asynced, reads = both_follows(
        client, client._blocking, lambda: client.async_redis, job_id, "1-18446744073709551616"
    )
    assert xreads(own_redis) - before == 2, "one XREAD per follow"
    assert reads == (["status", "final"] if finished else ["status"]) * 2, reads
    assert asynced == sync and [e.event for e in sync] == ["end"], sync
    end = json.loads(sync[0].data)
    assert end["reason"] == "stream_refused" and "Last-Event-ID" in end["message"], end
    assert end["status"] == ("failed" if finished else "queued"), end


def test_a_redis_outage_ends_the_follow_after_bounded_retries(
    client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis down (a loopback port nothing listens on; the studio's own Redis clients,
    worker.redis_conn): each follow tries REDIS_RETRIES reads, one status read before each,
    then ends with ``end`` reason redis_unavailable (the pause between tries shortened
    here: its length is not what is tested)."""
    from api_client import log_follower
    from testkit.processes import free_port
    from worker import redis_conn

    monkeypatch.setattr(log_follower, "REDIS_PAUSE_S", 0.01)
    monkeypatch.setattr(log_follower, "REDIS_PAUSE_MAX_S", 0.01)
    settings = client.settings.model_copy(
        update={"redis_url": f"redis://127.0.0.1:{free_port()}/0"}
    )
    down = redis_conn.client(settings, block_s=1.0)
    job_id = queued(client)
    sync, asynced, reads = both_follows(
        client,
        down,
        lambda: redis_conn.async_client(settings, block_s=1.0),
        job_id,
    )
    assert reads == ["status"] * log_follower.REDIS_RETRIES * 2, len(reads)
    assert asynced == sync and [e.event for e in sync] == ["end"], sync
    end = json.loads(sync[0].data)
    assert end["reason"] == "redis_unavailable" and end["status"] == "queued", end


def test_follow_marks_where_a_rerun_starts(client: Any) -> None:
    """An attempt lost mid-character (its worker died: no end mark), then the re-run's
    boundary (``{"rerun": "2"}``, as worker.job.log_publisher writes it) and its own text:
    both followers yield the lost attempt's text, a ``rerun`` event with attempt 2, then
    the second attempt's text (its first character whole: the lost attempt's half
    character is dropped)."""
    job_id = queued(client)
    job = client.store.get(job_id, inputs=True).to_job()
    client.store.finish(
        client._ended(job, Status.FAILED, ErrorCode.RUNTIME_UNAVAILABLE, "x"), worker="t"
    )
    key = logs_key(job_id)
    client.redis.xadd(key, {"d": b"attempt one caf\xc3"})  # its worker died: no end mark
    client.redis.xadd(key, {"rerun": b"2"})
    client.redis.xadd(key, {"d": b"\xc3\xa9 attempt two\n"})
    client.redis.xadd(key, {"end": b"1"})
    sync, asynced, _ = both_follows(client, client._blocking, lambda: client.async_redis, job_id)
    assert asynced == sync
    assert [(e.event, e.data) for e in sync][:4] == [
        ("log", "attempt one caf"),
        ("rerun", '{"attempt": 2}'),
        ("log", "é attempt two\n"),
        ("end", '{"status": "failed", "logs_truncated": false}'),
    ], sync


# --- WorkerRegistry / AsyncWorkerRegistry; _check_served / check_served_async ----------


def beat(client: Any, nodename: str, reason: str | None) -> Heartbeat:
    hb = Heartbeat(
        client.settings.redis_url,
        nodename,
        {QUEUE_TEST: 1, QUEUE_RUN: 2},
        interval_s=60,
        ttl_s=60,
        not_serving_reason=lambda: reason,
        store_id=client.store.store_id,
        client=redis.Redis.from_url(client.settings.redis_url),
    )
    hb.beat()
    return hb


def test_registries_read_the_same_workers(client: Any) -> None:
    """Both registries read the same announcements, with the same default queues."""
    hb = beat(client, "twin-a@test", None)
    try:
        sync = WorkerRegistry(client.redis).live()
        asynced = on_loop(client, lambda: AsyncWorkerRegistry(client.async_redis).live())
        assert sync == asynced
        assert [i.nodename for i in sync[QUEUE_TEST]] == ["twin-a@test"]
        assert [i.slots for i in sync[QUEUE_RUN]] == [2]
    finally:
        hb.stop()


def refused(client: Any, queue: str) -> list[str]:
    """The refusals of ``_check_served`` and ``check_served_async`` (each must refuse)."""
    out = []
    for check in (
        lambda: client._check_served(queue),
        lambda: on_loop(client, lambda: client.check_served_async(queue)),
    ):
        with pytest.raises(RuntimeUnavailable) as e:
            check()
        out.append(str(e.value))
    return out


def test_admission_beside_the_served_check_survives_a_script_flush(client: Any) -> None:
    """The HTTP test call's one round trip (``InFlight.admit`` with the ``ServedCheck``
    beside it, both scripts called by their hash): on a Redis that lost its scripts (both
    answer NoScriptError), the call is admitted exactly once and the served check refuses
    with the sync check's sentence."""
    from api_client.http.inflight import InFlight

    settings = client.settings
    client.settings = settings.model_copy(update={"queue_require_worker": True})
    user = f"beside-{uuid.uuid4().hex[:8]}"
    try:
        client.redis.script_flush()

        async def admit_and_judge() -> str:
            check = client.served_check(QUEUE_TEST)
            assert check is not None
            await InFlight(5).admit(client.async_redis, user, 30, 100, beside=check)
            with pytest.raises(RuntimeUnavailable) as e:
                await check.judge()
            return str(e.value)

        message = on_loop(client, admit_and_judge)
        with pytest.raises(RuntimeUnavailable) as e:
            client._check_served(QUEUE_TEST)
        assert message == str(e.value)
        assert client.redis.zcard(in_flight_key(user)) == 1
        assert client.redis.zcard(rate_key(user)) == 1
    finally:
        client.settings = settings


def test_check_served_refuses_alike(client: Any) -> None:
    """With STUDIO_QUEUE_REQUIRE_WORKER: no worker, or a paused one only, is refused with
    the same sentence by both checks; a serving one passes both."""
    settings = client.settings
    client.settings = settings.model_copy(update={"queue_require_worker": True})
    try:
        answers = []
        for hb in (None, beat(client, "twin-p@test", "its runtime is unavailable")):
            refusals = refused(client, QUEUE_TEST)
            assert refusals[0] == refusals[1]
            answers.append(refusals[0])
            if hb is not None:
                hb.stop()
        assert "Paused: twin-p@test (its runtime is unavailable)" in answers[1]
        hb = beat(client, "twin-s@test", None)
        try:
            client._check_served(QUEUE_TEST)
            client._served_until.clear()  # the yes is believed SERVED_CACHE_S: ask again
            on_loop(client, lambda: client.check_served_async(QUEUE_TEST))
        finally:
            hb.stop()
    finally:
        client.settings = settings
        client._served_until.clear()


def test_check_served_refuses_alike_when_redis_is_down(client: Any) -> None:
    """A registry that cannot be read (nothing listens on its port) is the same refusal
    in both checks."""
    from testkit.processes import free_port

    settings = client.settings.model_copy(
        update={"queue_require_worker": True, "redis_url": f"redis://127.0.0.1:{free_port()}/0"}
    )
    with CodeClient(settings, store=client.store) as down:
        refusals = [r.split(" (Error")[0] for r in refused(down, QUEUE_RUN)]
    assert refusals == ["The queue (Redis at STUDIO_REDIS_URL) cannot be read"] * 2, refusals
