"""Redis faults, with real processes: a silent cut of every connection between a worker
and its Redis (testkit/relay.py: no FIN, no RST, no reply; new connections held until the
heal), the same in front of the API's Redis, and a Sentinel failover during a burst.

Each test starts its own redis-server (or Sentinel deployment), relay, workers and API on
loopback; only processes started here are stopped, by pid. Timing is a hang guard here,
never a result: the figures are in ``make bench`` (bench/redis_faults.py).
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from testkit.processes import free_port, wait_for
from testkit.redis import take_lost
from testkit.relay import Relay
from testkit.sentinel import start_sentinels
from testkit.stack import Stack, client_for, env_for
from testkit.worker import CeleryWorker, health
from tests.snippets import TRIVIAL, USER

#: a node that takes a moment and says what it was given
WORK = "import time\n\ndef main(state):\n    time.sleep(0.2)\n    return state['n'] * 2\n"
#: how long the relay stays cut (new connections held) before the heal
CUT_S = 20
#: the longest a submit during a Sentinel failover may go unanswered (liveness, not speed)
ANSWER_BOUND_S = 30


def broker_lost(port: int) -> bool:
    code, body = health(port)
    return code == 503 and "broker connection lost" in str(body.get("checks", {}).get("paused"))


def submit_http(http: httpx.Client, n: int) -> httpx.Response:
    body = {"code": WORK, "language": "python", "state": {"n": n}}
    return http.post("/api/runs", json=body, headers={USER: "ann"})


def assert_all_doubled(q: Stack, jobs: dict[str, int], timeout_s: float) -> None:
    """Every job ended once, succeeded, with its own output. Prints its accounting line
    (accepted, ended per status, claimed more than once), also when some never end."""
    try:
        recs = q.wait_all(list(jobs), timeout_s)
    except AssertionError:
        print(f"\naccounting: {accounting(q, jobs)}", flush=True)
        raise
    print(f"\naccounting: {accounting(q, jobs)}", flush=True)
    wrong = {
        j: (r.status.value, r.output, r.error and r.error.message)
        for j, r in recs.items()
        if r.status != "succeeded" or r.output != 2 * jobs[j]
    }
    assert not wrong, f"{len(wrong)} of {len(jobs)} jobs did not end with their outcome: {wrong}"
    twice = {j: r.attempts for j, r in recs.items() if r.attempts > 1}
    assert not twice, f"jobs claimed more than once: {twice}"


def accounting(q: Stack, jobs: dict[str, int]) -> str:
    """accepted N; succeeded with their own output S; each other state and its count;
    claimed more than once C (the run store's word)."""
    recs = q.client.store.get_many(list(jobs), inputs=False)
    ends: dict[str, int] = {}
    for j, r in recs.items():
        key = r.status.value
        if key == "succeeded" and r.output != 2 * jobs[j]:
            key = "succeeded with a wrong output"
        ends[key] = ends.get(key, 0) + 1
    missing = len(jobs) - len(recs)
    twice = sum(1 for r in recs.values() if r.attempts > 1)
    others = ", ".join(f"{k} {n}" for k, n in sorted(ends.items()) if k != "succeeded")
    return (
        f"accepted {len(jobs)}, succeeded {ends.get('succeeded', 0)}"
        + (f", {others}" if others else "")
        + (f", no row {missing}" if missing else "")
        + f", claimed more than once {twice}"
    )


# --- "serving" is proven ---------------------------------------------------------------------


@pytest.mark.redis
def test_a_queue_whose_consumer_shows_no_round_trip_is_announced_paused(
    redis_server: Any, tmp_path: Path, make_settings: Any
) -> None:
    """The heartbeat itself on a real Redis, with the broker watch of this process: the
    code.run consumer's last answer from Redis is a minute old, code.test's is fresh. Only
    code.run is announced paused ("broker connection lost"), the API refuses a run and
    takes a test call, and readiness names the lost broker."""
    from api_client import CodeClient, RuntimeUnavailable
    from worker.upkeep import broker_watch
    from worker.upkeep.gate_watch import gate_checks
    from worker.upkeep.heartbeat import Heartbeat

    settings = make_settings(
        redis_url=redis_server.url,
        database_url=f"sqlite:///{tmp_path / 'runs.db'}",
        queue_heartbeat_interval_s=0.2,
    )
    trips = broker_watch.ROUND_TRIPS
    trips.forget()
    trips.seen(["code.run"], at=time.monotonic() - 60)
    trips.seen(["code.test"])
    beat = Heartbeat(
        redis_server.url,
        "cut@test",
        {"code.run": 1, "code.test": 1},
        interval_s=0.2,
        ttl_s=1.6,
        queue_reason=lambda q: broker_watch.lost_reason(q, settings.redis_dead_after_s),
    )
    beat.start()
    client = CodeClient(settings)
    try:
        live = client.live_workers()
        run, test = live["code.run"][0], live["code.test"][0]
        assert run.state == "paused" and "broker connection lost" in (run.reason or ""), run
        assert test.serving, test
        with pytest.raises(RuntimeUnavailable) as caught:
            client.submit(WORK, "python", {"n": 1})
        assert "Paused: cut@test (broker connection lost" in caught.value.message
        assert client.status(client.submit(WORK, "python", {"n": 1}, kind="test")).status == (
            "queued"
        )
        assert "broker connection lost" in str(gate_checks(settings)["paused"])
        trips.seen(["code.run"])  # its consumer answers again
        wait_for(lambda: client.live_workers()["code.run"][0].serving, 5, "code.run served")
        assert gate_checks(settings)["paused"] is None
    finally:
        beat.stop()
        client.close()
        trips.forget()


@pytest.mark.redis
@pytest.mark.timeout(60)
def test_a_stuck_consumer_exits_the_worker_with_a_json_line(redis_server: Any) -> None:
    """The watchdog in a process of its own: a consumer with no round trip for longer
    than STUDIO_REDIS_GIVE_UP_S while Redis answers a new connection exits the process
    with code 75 and says why in one JSON line on stderr; while Redis does not answer, it
    waits."""
    import subprocess
    import sys

    def run(url: str, sleep_s: float) -> subprocess.CompletedProcess[str]:
        script = f"""
import time
from executor.settings import load_settings
from worker.upkeep import broker_watch
settings = load_settings(redis_url={url!r}, redis_give_up_s=1)
broker_watch.ROUND_TRIPS.seen(["code.run"], at=time.monotonic() - 30)
dog = broker_watch.BrokerWatchdog(settings, ["code.run"], settings.redis_give_up_s)
dog.start()
time.sleep({sleep_s})
print("still alive")
"""
        return subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=40
        )

    proc = run(redis_server.url, 20)
    assert proc.returncode == 75, (proc.returncode, proc.stdout, proc.stderr)
    lines = [json.loads(x) for x in proc.stderr.splitlines() if x.startswith("{")]
    assert lines and lines[-1]["code"] == "BROKER_CONSUMER_STUCK", proc.stderr
    assert lines[-1]["queue"] == "code.run" and lines[-1]["exit_code"] == 75
    assert "still alive" not in proc.stdout
    # Redis itself unreachable: a new process could not do better, so it waits
    proc = run(f"redis://127.0.0.1:{free_port()}/0", 4)
    assert proc.returncode == 0 and "still alive" in proc.stdout, (proc.stdout, proc.stderr)


# --- the worker's Redis goes silent ----------------------------------------------------------


@pytest.mark.redis
@pytest.mark.timeout(180)
def test_a_worker_paused_longer_than_the_dead_bound_keeps_its_broker(
    make_stack: Any, sqlite_url: str
) -> None:
    """The worker's gate cancels its consumers while the run store takes no write (here:
    another process holds SQLite's write lock): no BRPOP goes out, yet the connection is
    alive. A pause three times STUDIO_REDIS_GIVE_UP_S long is not a lost broker: the
    worker does not exit, does not drop its connection when it resumes (which would strand
    the ack of the job that ran through the pause and hand its message out again), and
    the job that ran through it ends once, succeeded, as does one sent after it."""
    import sqlite3

    q = make_stack(code_runtime="subprocess", redis_dead_after_s=2, redis_give_up_s=3)
    port = free_port()
    worker = q.start_worker("w", 1, metrics_port=port, queue_probe_interval_s=1)
    slow = q.client.submit(
        "import time\n\ndef main(state):\n    time.sleep(2)\n    return 'through'\n",
        "python",
    )
    wait_for(lambda: q.client.status(slow).status == "running", 30, "the slow job running")
    conn = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), timeout=30, isolation_level=None)
    conn.execute("BEGIN EXCLUSIVE")  # its result cannot be written until the ROLLBACK
    try:

        def paused() -> bool:
            assert worker.alive(), f"the paused worker exited:\n{worker.tail()}"
            code, body = health(port)
            return code == 503 and "run store" in str(body["checks"]["paused"])

        wait_for(paused, 15, "readiness 503 naming the store")
        until = time.monotonic() + 9  # 3 x STUDIO_REDIS_GIVE_UP_S
        while time.monotonic() < until:
            assert paused(), health(port)
            time.sleep(0.5)
    finally:
        conn.execute("ROLLBACK")
        conn.close()
    wait_for(lambda: health(port)[0] == 200, 30, "the worker ready again", 0.2)
    wait_for(lambda: q.client.live_workers()["code.run"][0].serving, 30, "served again", 0.2)
    after = q.client.submit(WORK, "python", {"n": 21})
    recs = q.wait_all([slow, after], 60)
    assert recs[slow].status == "succeeded" and recs[slow].output == "through", recs[slow]
    assert recs[after].status == "succeeded" and recs[after].output == 42, recs[after]
    time.sleep(1.5)  # a redelivery of the slow job would be skipped and announced now
    assert {j: (r.attempts, q.done_count(j)) for j, r in recs.items()} == {
        slow: (1, 1),
        after: (1, 1),
    }
    log = worker.output()
    for sign in ("broker connection lost", "Connection to broker lost", "BROKER_CONSUMER_STUCK"):
        assert sign not in log, f"{sign!r} in the worker's log:\n{worker.tail()}"
    assert worker.alive(), worker.tail()


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.timeout(420)
def test_a_silent_broker_is_noticed_refused_and_left(
    make_stack: Any, redis_server: Any, tmp_path: Path
) -> None:
    """Every connection of a worker to Redis goes silent and new ones are held for 20 s:
    the worker says it lost its broker (readiness 503, paused "broker connection lost"),
    the API's submit answers 503 at once; after the heal, jobs submitted before, during and
    after the cut all succeed, each once."""
    # the test's own client submits whatever the heartbeats say (the API checks them)
    q = make_stack(queue_require_worker=False, queue_heartbeat_interval_s=1)
    port = free_port()
    with Relay(redis_server.port) as relay:
        worker = q.start_worker("w1", 2, redis_url=relay.url(), metrics_port=port)
        api = q.start_api(queue_require_worker=True)
        http = httpx.Client(base_url=api.base, timeout=60)
        try:
            jobs = {q.client.submit(WORK, "python", {"n": i}): i for i in range(4)}
            wait_for(lambda: health(port)[0] == 200, 30, "the worker ready", 0.2)
            assert submit_http(http, 100).status_code == 202
            relay.cut()
            cut_at = time.monotonic()

            wait_for(lambda: broker_lost(port), 40, "readiness 503: broker connection lost", 0.5)
            noticed_s = time.monotonic() - cut_at
            jobs.update({q.client.submit(WORK, "python", {"n": 10 + i}): 10 + i for i in range(4)})
            # its announcements are not renewed: the API refuses what only it would take
            wait_for(lambda: submit_http(http, 1).status_code == 503, 30, "the API's 503", 0.2)
            refused_s = time.monotonic() - cut_at
            for i in range(3):
                r = submit_http(http, i)
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "RUNTIME_UNAVAILABLE", r.text
            assert cut_at + CUT_S > time.monotonic(), "the cut ended before it was checked"
            time.sleep(max(0.0, cut_at + CUT_S - time.monotonic()))
            relay.heal()
            healed_at = time.monotonic()

            jobs.update({q.client.submit(WORK, "python", {"n": 20 + i}): 20 + i for i in range(4)})
            assert_all_doubled(q, jobs, 60)
            print(
                f"\ncut: paused after {noticed_s:.1f} s, the API refused after {refused_s:.1f} s; "
                f"all {len(jobs)} jobs done {time.monotonic() - healed_at:.1f} s after the heal"
            )
            wait_for(lambda: health(port)[0] == 200, 60, "the worker ready again", 0.5)
            wait_for(lambda: submit_http(http, 7).status_code == 202, 30, "the API's 202", 0.2)
            out = worker.output()
            assert "broker connection lost" in out, worker.tail()
            assert worker.alive()
        finally:
            http.close()
            api.stop()


# --- the API's Redis goes silent -------------------------------------------------------------


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.timeout(300)
def test_a_waiting_test_call_answers_when_the_apis_redis_goes_silent(
    make_stack: Any, redis_server: Any, tmp_path: Path
) -> None:
    """The relay in front of the API's Redis only (the worker reaches Redis directly): a
    POST /api/code/test waiting for its result when every connection goes silent answers
    with the result (the run store says it), and a new one answers 503, neither hangs."""
    q = make_stack()
    q.start_worker("w1", 2)
    sleepy = "import time\n\ndef main(state):\n    time.sleep(3)\n    return state['n'] * 2\n"
    with Relay(redis_server.port) as relay:
        api = q.start_api(redis_url=relay.url())
        # a hang guard far past the call's own wait (timeout_s + its margin + one bound)
        http = httpx.Client(base_url=api.base, timeout=120)
        try:
            body = {"code": sleepy, "language": "python", "state": {"n": 4}, "timeout_s": 10}
            r = http.post("/api/code/test", json=body, headers={USER: "ann"})  # warm
            assert r.status_code == 200 and r.json()["output"] == 8, r.text
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                call = pool.submit(http.post, "/api/code/test", json=body, headers={USER: "ann"})
                time.sleep(1.5)  # submitted, now waiting on its done notice
                relay.cut()
                r = call.result()
            assert r.status_code in (200, 202), r.text
            assert r.json()["status"] in ("running", "succeeded"), r.text
            if r.status_code == 200:
                assert r.json()["output"] == 8, r.text
            # while cut: a new call is answered (503: Redis cannot be read), never held
            r = http.post("/api/code/test", json=body, headers={USER: "ann"})
            assert r.status_code == 503, r.text
            relay.heal()
            wait_for(
                lambda: (
                    http.post("/api/code/test", json=body, headers={USER: "ann"}).status_code == 200
                ),
                60,
                "a test call answered 200 again after the heal",
                0.5,
            )
        finally:
            http.close()
            api.stop()


# --- Sentinel: the primary dies during a burst -----------------------------------------------


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.timeout(900)
def test_sentinel_failover_during_a_burst_loses_no_job(
    sqlite_url: str, tmp_path: Path, python_image: str
) -> None:
    """A primary, a replica and three sentinels (passwords on the master and on the
    sentinels); the primary SIGKILLed during a 120-job burst on 2 workers: every job ends
    exactly once with its real outcome (the run store says so), none lost or stuck (what
    async replication lost is sent again by the queued sweep); submits through the API
    during the failover are each answered within ANSWER_BOUND_S (a liveness bound: 202 or
    503, never held), and the API accepts runs again once the sentinels name the new
    primary: every accepted run, those too, ends succeeded exactly once."""
    sentinel_env = {
        "redis_sentinel_master": "studio",
        "redis_sentinel_password": "sentinel-secret-1",
        "queue_lost_after_s": 10,
        "queue_heartbeat_interval_s": 1,
        # two workers of three pool processes, all for code.run (this burst has no test call)
        "code_concurrency": 3,
        "queue_test_slots": 0,
    }
    with start_sentinels(
        tmp_path, password="master-secret-1", sentinel_password="sentinel-secret-1"
    ) as sentinels:
        q = Stack(
            tmp_path,
            redis_url=sentinels.url,
            database_url=sqlite_url,
            code_image=python_image,
            **sentinel_env,
        )
        try:
            q.start_worker("w1", 3)
            q.start_worker("w2", 3)
            api = q.start_api()
            http = httpx.Client(base_url=api.base, timeout=ANSWER_BOUND_S)
            try:
                jobs = {q.client.submit(WORK, "python", {"n": i}): i for i in range(120)}
                wait_for(
                    lambda: (
                        sum(r.finished for r in q.client.store.get_many(list(jobs)).values()) >= 30
                    ),
                    120,
                    "30 jobs finished",
                    0.1,
                )
                dead = sentinels.kill_primary()
                new_port = sentinels.ports[sentinels.other(dead)]
                # (status, the new primary named before the submit was sent)
                answered: list[tuple[int, bool]] = []
                named_at: float | None = None
                deadline = time.monotonic() + 120  # a hang guard, not a measure
                while time.monotonic() < deadline:
                    if named_at is None and sentinels.master_port() == new_port:
                        named_at = time.monotonic()
                    n = 1000 + len(answered)
                    try:
                        r = submit_http(http, n)
                    except httpx.TimeoutException:
                        pytest.fail(
                            f"a submit during the failover was not answered within "
                            f"{ANSWER_BOUND_S} s (answered before it: {answered})"
                        )
                    answered.append((r.status_code, named_at is not None))
                    if r.status_code == 202:
                        jobs[r.json()["job_id"]] = n
                    after = [code for code, named in answered if named]
                    if after.count(202) >= 3:
                        break
                    time.sleep(0.5)
                print(f"\nsubmits during the failover answered (status, after it): {answered}")
                assert {code for code, _ in answered} <= {202, 503}, answered
                assert named_at is not None, "the sentinels never named the replica primary"
                accepted_after = [code for code, named in answered if named and code == 202]
                assert accepted_after, (
                    f"no submit was accepted after the new primary was named: {answered}"
                )
                assert_all_doubled(q, jobs, 600)
                assert all(w.alive() for w in q.workers), [w.tail() for w in q.workers]
            finally:
                http.close()
        finally:
            q.stop()


@pytest.mark.redis
@pytest.mark.timeout(180)
def test_a_delivery_a_failover_left_without_its_worker_is_sent_again_on_the_new_primary(
    sqlite_url: str, tmp_path: Path, make_settings: Any
) -> None:
    """Redis made to lose an acknowledged message on purpose, as a Sentinel failover does:
    a job's message taken by a worker and lost with its connection (the delivery written
    to kombu's unacked hash and index and replicated), then the primary SIGKILLed. The new
    primary holds a delivery no worker has, which kombu would hand out only after its
    visibility timeout (150 s here). A worker connected to the old primary follows the
    failover, its sweep (lock, reads, script, resend on the new primary) sends the job
    again within STUDIO_QUEUE_HELD_LOST_AFTER_S + a sweep: the run succeeds once, well
    before the visibility timeout (the 60 s wait is that proof, not a speed)."""
    from executor.models import CodeJob
    from worker.protocol import KOMBU_UNACKED, TASK_NAME, job_headers

    held_s = 6
    with start_sentinels(tmp_path) as sentinels:
        env = env_for(
            sentinels.url,
            sqlite_url,
            STUDIO_REDIS_SENTINEL_MASTER=sentinels.master,
            STUDIO_QUEUE_LOST_AFTER_S="1",
            STUDIO_QUEUE_HELD_LOST_AFTER_S=str(held_s),
            STUDIO_QUEUE_RUN_FAIRNESS="off",
            STUDIO_QUEUE_TEST_SLOTS="0",
            STUDIO_CODE_MAX_SECONDS="15",
        )
        w = CeleryWorker(env, tmp_path / "w.log", name="follower", concurrency=1, queues="code.run")
        client = client_for(
            make_settings,
            sentinels.url,
            sqlite_url,
            redis_sentinel_master=sentinels.master,
            queue_require_worker=False,
            queue_run_fairness="off",
            code_max_seconds=15,
        )
        try:
            w.wait_ready()
            # a job whose message waits on a list no worker reads; taken from there and lost
            job = CodeJob(code=TRIVIAL, state_json='{"n": 21}', kind="run", user="ann")
            assert client.store.create(job, code_runtime="subprocess")
            client.app.send_task(
                TASK_NAME,
                args=(job.job_id,),
                task_id=job.job_id,
                queue="parking",
                ignore_result=True,
                headers=job_headers(client.store.store_id, client.store.describe()),
            )
            tag = take_lost(client.app, "parking")
            primary = redis.Redis(port=sentinels.master_port() or 0, socket_timeout=5)
            assert primary.wait(1, 5000) == 1, "the replica has the delivery"
            primary.close()
            dead = sentinels.kill_primary()
            new_port = sentinels.ports[sentinels.other(dead)]
            sentinels.wait_master(new_port)
            new = redis.Redis(port=new_port, socket_timeout=5)
            try:
                assert new.hexists(KOMBU_UNACKED, tag), "the failover kept the delivery"
                assert client.store.get(job.job_id, inputs=False).status == "queued"
                rec = client.wait(job.job_id, 60)
                assert rec.status == "succeeded" and rec.output == 42, w.output()[-3000:]
                assert rec.attempts == 1, rec
                assert "sent again" in w.output()
                assert not new.hexists(KOMBU_UNACKED, tag), "the stale delivery was removed"
            finally:
                new.close()
        finally:
            client.close()
            w.stop(30)


@pytest.mark.redis
@pytest.mark.timeout(240)
def test_a_message_the_old_primary_acknowledged_and_never_replicated_is_sent_again(
    sqlite_url: str, tmp_path: Path, make_settings: Any
) -> None:
    """Redis made to lose an acknowledged message on purpose, as asynchronous replication
    does in a failover: the replica reaches its primary through a relay that is silenced,
    a run is submitted (the primary acknowledges its message: it is on the primary's
    code.run list, never on the replica), then the primary is SIGKILLed and the sentinels
    promote the replica. The new primary has no trace of the message; the run store's row
    (queued, 0 attempts) is the only promise left. The worker, connected to the old primary
    all along (its one slot busy with a slower run, so the message waited), follows the
    failover, and its queued sweep (lock, reads, resend on the new primary) sends the run
    again once it is STUDIO_QUEUE_LOST_AFTER_S old: it succeeds, claimed once. Without the
    sweep it would wait out STUDIO_QUEUE_RUN_MAX_WAIT_S (30 min): the 90 s wait is a hang
    guard far below that, not a speed."""
    from worker.protocol import KOMBU_UNACKED, QUEUE_RUN, message_job_id, queue_lists

    slow = "import time\n\ndef main(state):\n    time.sleep(state['s'])\n    return state['s']\n"
    with start_sentinels(tmp_path, relayed_replica=True) as sentinels:
        env = env_for(
            sentinels.url,
            sqlite_url,
            STUDIO_REDIS_SENTINEL_MASTER=sentinels.master,
            STUDIO_QUEUE_LOST_AFTER_S="3",
            STUDIO_QUEUE_RUN_FAIRNESS="off",
            STUDIO_QUEUE_TEST_SLOTS="0",
            STUDIO_CODE_MAX_SECONDS="30",
        )
        w = CeleryWorker(env, tmp_path / "w.log", name="follower", concurrency=1, queues="code.run")
        client = client_for(
            make_settings,
            sentinels.url,
            sqlite_url,
            redis_sentinel_master=sentinels.master,
            queue_require_worker=False,
            queue_run_fairness="off",
            code_max_seconds=30,
        )
        primary = new = None
        try:
            w.wait_ready()
            # the worker's only slot busy: the next message waits on the list
            busy = client.submit(slow, "python", {"s": 8}, user="ann")
            wait_for(
                lambda: client.store.get(busy, inputs=False).status == "running",
                60,
                "the slow run running",
            )
            old_port = sentinels.master_port() or 0
            primary = redis.Redis(port=old_port, socket_timeout=5)
            assert primary.wait(1, 5000) == 1, "the replica has everything so far"
            sentinels.cut_replication()
            job = client.submit(TRIVIAL, "python", {"n": 21}, user="ann")

            def waiting(r: redis.Redis) -> list[str]:
                return [
                    str(message_job_id(m))
                    for key in queue_lists(QUEUE_RUN)
                    for m in r.lrange(key, 0, -1)
                ]

            # acknowledged by the primary, never on the replica
            assert waiting(primary) == [job], waiting(primary)
            assert primary.wait(1, 500) == 0, "the replica acknowledged the message"
            dead = sentinels.kill_primary()
            new_port = sentinels.ports[sentinels.other(dead)]
            sentinels.wait_master(new_port)
            new = redis.Redis(port=new_port, socket_timeout=5)
            assert waiting(new) == [], "the failover kept the message"
            held = new.hvals(KOMBU_UNACKED)
            assert not any(job.encode() in v for v in held), "the failover kept a delivery"
            rec = client.store.get(job, inputs=False)
            assert (rec.status, rec.attempts) == ("queued", 0), rec
            done = client.wait(job, 90)
            assert done.status == "succeeded" and done.output == 42, w.output()[-3000:]
            assert done.attempts == 1, done
            assert "sent again" in w.output() and job in w.output(), w.output()[-3000:]
            ended = client.wait(busy, 60)
            assert ended.status == "succeeded" and ended.output == 8, ended
        finally:
            for c in (primary, new):
                if c is not None:
                    c.close()
            client.close()
            w.stop(30)
