"""Fair share of code.run between users (worker.fair): the scripts on a real redis-server,
then the whole path with real worker processes (the Docker runtime, as tests/test_queue.py).
Timing is measured and printed, never asserted: the fairness checks count jobs (how many of
the flood's runs started between another user's submit and its start), bench/fair.py
measures the delays."""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import pytest

from testkit.fair import announce, drain, released
from testkit.processes import wait_for
from testkit.sandboxes import containers_of, sandbox_events
from tests.snippets import TRIVIAL, sleeper

# --- the scripts, on a real redis-server -----------------------------------------------------


def _message(job_id: str, user: str) -> str:
    """A stand-in for kombu's message: the scripts move it as opaque text."""
    return json.dumps({"headers": {"id": job_id, "studio_fair_user": user}, "body": job_id})


@pytest.mark.redis
def test_runs_are_released_in_turns_by_user(redis_server: Any) -> None:
    import redis

    from worker.fair import FairQueue

    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    fair = FairQueue(r, cap=0)
    announce(r, 2)  # room: 2 run slots -> 2 messages ahead
    for i in range(10):
        fair.enqueue(f"a{i}", "ann", _message(f"a{i}", "ann"))
    assert released(r) == ["a0", "a1"], "a user alone takes every free slot at once"
    fair.enqueue("b0", "bob", _message("b0", "bob"))
    fair.enqueue("c0", "cy", _message("c0", "cy"))
    fair.enqueue("b1", "bob", _message("b1", "bob"))
    where = fair.where("c0")
    assert where is not None and where.user == "cy" and where.position == 0
    assert where.users_ahead == 2 and where.users_waiting == 3  # ann's and bob's turns first
    assert fair.where("a0") is None  # released: in code.run
    stats = fair.stats()
    assert (stats.waiting, stats.users_waiting, stats.held) == (11, 3, 2)
    assert (stats.top[0].user, stats.top[0].waiting, stats.top[0].held) == ("ann", 8, 2)
    assert r.llen("studio:fair:backlog") == 11
    # one turn each: bob and cy wait behind one run of ann's, never her backlog
    assert drain(r, fair, 6) == ["a2", "b0", "c0", "a3", "b1", "a4"]
    assert fair.forget(["a9"]) == 1 and fair.forget(["a9"]) == 0
    assert fair.stats().waiting == 4 == r.llen("studio:fair:backlog")
    assert drain(r, fair, 10) == ["a5", "a6", "a7", "a8"], "a user alone takes every turn"
    assert fair.stats().waiting == 0 and r.zcard("studio:fair:users") == 0
    assert fair.stats().held == 12
    r.close()


@pytest.mark.redis
def test_user_cap_parks_a_user_until_one_of_theirs_ends(redis_server: Any) -> None:
    import redis

    from worker.fair import FairQueue

    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    fair = FairQueue(r, cap=2)
    announce(r, 8)
    for i in range(5):
        fair.enqueue(f"a{i}", "ann", _message(f"a{i}", "ann"))
    fair.enqueue("b0", "bob", _message("b0", "bob"))
    assert released(r) == ["a0", "a1", "b0"], "ann is at her cap of 2; bob is not held"
    where = fair.where("a2")
    assert where is not None and where.users_ahead is None  # parked at the cap
    assert where.as_dict()["held_by"] == "user_cap"
    r.delete("code.run")
    assert fair.release() == 0, "the cap holds with room in code.run"
    assert fair.ended(["a0"]) == 1 and released(r) == ["a2"]
    assert fair.ended(["a0"]) == 0, "an end counts once"
    assert fair.ended(["b0"]) == 0
    assert fair.ended(["a1", "a2"]) == 2 and released(r) == ["a2", "a3", "a4"]
    assert fair.stats().held == 2 and fair.stats().waiting == 0
    assert fair.held() == {"a3": "ann", "a4": "ann"}
    r.close()


@pytest.mark.redis
def test_without_live_workers_only_a_few_runs_go_to_code_run(redis_server: Any) -> None:
    import redis

    from worker.fair import FairQueue
    from worker.protocol import FAIR_MIN_AHEAD

    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    fair = FairQueue(r, cap=0)
    for i in range(6):
        fair.enqueue(f"a{i}", "", _message(f"a{i}", ""))  # no user: one shared bucket
    assert r.llen("code.run") == FAIR_MIN_AHEAD
    assert r.llen("studio:fair:backlog") == 6 - FAIR_MIN_AHEAD
    for job in ("a0", "a5"):  # a publish retried, of a released and of a waiting run
        fair.enqueue(job, "", _message(job, ""))
    assert r.llen("code.run") == FAIR_MIN_AHEAD
    assert r.llen("studio:fair:backlog") == 6 - FAIR_MIN_AHEAD
    announce(r, 3)
    assert fair.release() == 1 and r.llen("code.run") == 3
    r.close()


@pytest.mark.redis
def test_queued_sweep_sees_runs_on_users_lists(
    redis_server: Any, tmp_path: Any, make_settings: Any
) -> None:
    """Runs waiting on a user's list are not lost messages; released runs whose message is
    gone are; released runs that ended unseen free their user's cap slots."""
    from api_client import CodeClient
    from worker.upkeep.queued import QueuedSweep

    settings = make_settings(
        redis_url=redis_server.url,
        database_url=f"sqlite:///{tmp_path / 'fair.db'}",
        queue_require_worker=False,  # no worker: runs stay queued
        queue_lost_after_s=0.2,
        queue_run_user_slots=1,
    )
    with CodeClient(settings) as client:
        ids = [client.submit(TRIVIAL, "python", {}, user="ann") for _ in range(5)]
        released = [j for j in ids if client.where(j) is None]
        assert released == ids[:1], "ann's cap is 1"
        client.redis.delete("code.run")  # the released runs' messages are lost
        time.sleep(0.3)
        sweep = QueuedSweep(settings, client.store, client.app, "sweeper@test")
        try:
            assert sweep.resend_lost() == sorted(released), "only the lost ones are sent again"
            assert client.redis.llen("code.run") == 1
            assert client.fairness()["waiting"] == 4
            assert sweep.reconcile() == []  # the released ones are still queued
            for j in released:
                assert client.cancel(j) == "cancelled"
            assert sweep.reconcile() == sorted(released)
            # ann's cap slots are free again: one more of hers is released
            assert client.fairness()["released_not_ended"] == 1
            assert client.redis.llen("code.run") == 2
            assert client.where(ids[1]) is None and client.where(ids[2]) is not None
        finally:
            sweep.close()


@pytest.mark.redis
def test_api_says_where_a_run_waits(redis_server: Any, tmp_path: Any, make_settings: Any) -> None:
    """GET /api/runs/{id} of a run held back by fairness says where it waits; meta shows
    the mode and the users with the most runs waiting (through the app, httpx's ASGI
    transport, on a real redis-server)."""
    import asyncio

    import httpx

    from api_client import CodeClient
    from api_client.http.app import create_app

    settings = make_settings(
        redis_url=redis_server.url,
        database_url=f"sqlite:///{tmp_path / 'fair.db'}",
        queue_require_worker=False,
    )
    with CodeClient(settings) as client:
        ann = [client.submit(TRIVIAL, "python", {}, user="ann") for _ in range(4)]
        bob = client.submit(TRIVIAL, "python", {}, user="bob")
        app = create_app(settings, client=client)

        async def get(path: str, user: str, admin: bool = False) -> Any:
            transport = httpx.ASGITransport(app=app)
            headers = {"X-Studio-User": user, **({"X-Studio-Admin": "1"} if admin else {})}
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as h:
                r = await h.get(path, headers=headers)
                assert r.status_code == 200, r.text
                return r.json()

        # no worker runs here: that is said first, with the run's place on its user's list
        first = asyncio.run(get(f"/api/runs/{ann[0]}", "ann"))
        assert first["status"] == "queued" and first["waiting"]["held_by"] == "no_worker"
        assert first["waiting"]["position"] is None  # released: in code.run, on no list
        last = asyncio.run(get(f"/api/runs/{ann[3]}", "ann"))
        assert {k: last["waiting"][k] for k in WHERE} == {
            "queue": "code.run",
            "held_by": "no_worker",
            "position": 1,
            "users_ahead": 0,  # bob came in at the clock, tied with ann: by name
            "users_waiting": 2,
        }
        meta = asyncio.run(get("/api/meta/runtime", "root", admin=True))["fairness"]
        assert meta["mode"] == "users" and meta["user_slots"] is None
        assert meta["waiting"] == 3 and meta["users_waiting"] == 2
        assert meta["top"] == [
            {"rank": 1, "user": "ann", "waiting": 2, "running": 2},
            {"rank": 2, "user": "bob", "waiting": 1, "running": 0},
        ]
        # a user is shown the ranks, never who the others are (admins only)
        mine = asyncio.run(get("/api/meta/runtime", "ann"))["fairness"]
        assert mine["top"] == [
            {"rank": 1, "waiting": 2, "running": 2},
            {"rank": 2, "waiting": 1, "running": 0},
        ]
        assert client.where(bob) is not None


#: the fields of a run's ``waiting`` that say where it is on its user's list
WHERE = ("queue", "held_by", "position", "users_ahead", "users_waiting")


# --- the whole path: real client, real workers -----------------------------------------------


def _started_between(recs: dict[str, Any], ids: list[str], after: Any, before: Any) -> int:
    """How many of ``ids`` a worker claimed after ``after`` and before ``before``."""
    return sum(1 for j in ids if recs[j].started_at and after < recs[j].started_at < before)


def _peak(recs: list[Any]) -> int:
    """Most of ``recs`` running at once, from the store's started/finished times."""
    edges = sorted(
        [(r.started_at, 1) for r in recs] + [(r.finished_at, -1) for r in recs],
        key=lambda e: (e[0], e[1]),  # an end before a start at the same instant
    )
    now = peak = 0
    for _, step in edges:
        now += step
        peak = max(peak, now)
    return peak


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_other_users_runs_start_behind_a_flood_in_turns(make_stack: Any) -> None:
    """User ann queues 200 runs, then bob and cy one each: theirs start after a few of
    ann's (the messages already in code.run, one per run slot), not after her 200; all of
    ann's succeed, each exactly once."""
    q = make_stack(code_concurrency=2, queue_test_slots=0)
    workers = [q.start_worker("w1", 2), q.start_worker("w2", 2)]
    run_slots = 4
    flood = [q.client.submit(TRIVIAL, "python", {"n": i}, user="ann") for i in range(200)]
    time.sleep(1.0)  # the flood is under way
    bob = q.client.submit(TRIVIAL, "python", {"n": 1000}, user="bob")
    cy = q.client.submit(TRIVIAL, "python", {"n": 2000}, user="cy")
    recs = q.wait_all([*flood, bob, cy], 300)
    others = {"bob": recs[bob], "cy": recs[cy]}
    assert all(r.status == "succeeded" for r in recs.values()), Counter(
        r.status for r in recs.values()
    )
    assert [recs[j].output for j in flood] == [2 * i for i in range(200)]
    assert all(recs[j].attempts == 1 for j in flood)
    assert all(q.done_count(j) == 1 for j in flood), "each run's task body ended exactly once"
    durations = sorted((r.finished_at - r.started_at).total_seconds() for r in recs.values())
    one_job = durations[len(durations) // 2]
    for name, rec in others.items():
        ahead = _started_between(recs, flood, rec.queued_at, rec.started_at)
        delay = (rec.started_at - rec.queued_at).total_seconds()
        print(
            f"\n{name}: started {delay:.2f} s after its submit, behind {ahead} of ann's runs "
            f"(3 x one job = {3 * one_job:.2f} s; ann's flood: 200 runs)"
        )
        # FIFO would put ~190 of ann's runs first; fair: what was in code.run and running
        assert ahead <= 2 * run_slots + 2, (name, ahead)
    by_worker = Counter((r.worker or "").split("@")[0] for r in recs.values())
    assert set(by_worker) == {w.name for w in workers}
    assert q.client.fairness()["waiting"] == 0


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.timeout(180)
def test_cancel_of_a_run_waiting_behind_fairness(make_stack: Any, docker_client: Any) -> None:
    """A run held back on its user's list is cancelled: it ends cancelled at once, leaves
    the list, and never gets a sandbox; the runs around it all run."""
    # a pre-started sandbox renamed after any job it runs: the events below would show one
    q = make_stack(code_concurrency=1, queue_test_slots=0, code_prewarm_rename_after_s=0)
    q.start_worker("w1", 1)
    since = int(time.time()) - 1
    runs = [q.client.submit(sleeper(0.5, f"r{i}"), "python", {}, user="ann") for i in range(6)]
    last = runs[-1]
    where = q.client.where(last)
    assert where is not None, "one run slot: code.run holds 2 of 6, the rest wait on ann's list"
    assert where.user == "ann" and where.position >= 1 and where.users_ahead == 0
    assert q.client.cancel(last) == "cancelled"
    assert q.client.where(last) is None
    assert not q.client.redis.hexists("studio:fair:jobs", last)
    recs = q.wait_all(runs, 120)
    assert [recs[j].status for j in runs[:-1]] == ["succeeded"] * 5
    assert [recs[j].output for j in runs[:-1]] == [f"r{i}" for i in range(5)]
    cancelled = recs[last]
    assert cancelled.status == "cancelled" and cancelled.started_at is None
    assert cancelled.error and cancelled.error.code == "CODE_CANCELLED"
    events = sandbox_events(docker_client, last, since, int(time.time()) + 1)
    assert events == [], "a run cancelled while waiting on its user's list never gets a sandbox"
    stats = q.client.fairness()
    assert stats["waiting"] == 0 and stats["mode"] == "users"


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.timeout(180)
def test_worker_sigkill_while_runs_wait_loses_none(make_stack: Any, docker_client: Any) -> None:
    """The only worker is SIGKILLed (main process and pool) mid-job while runs of two users
    wait on their lists; a new worker runs every one of them, each exactly once."""
    q = make_stack(
        code_concurrency=1, queue_test_slots=0, code_max_seconds=5, queue_visibility_timeout_s=6
    )
    w1 = q.start_worker("w1", 1)
    runs = [q.client.submit(sleeper(0.5, "a"), "python", {}, user="ann") for _ in range(8)]
    runs += [q.client.submit(sleeper(0.5, "b"), "python", {}, user="bob") for _ in range(2)]
    wait_for(
        lambda: any(containers_of(docker_client, j, running=True) for j in runs),
        60,
        "a run's sandbox",
    )
    assert q.client.fairness()["waiting"] > 0, "runs wait on the users' lists"
    w1.kill_hard()
    time.sleep(1.0)
    q.start_worker("w2", 1)
    recs = q.wait_all(runs, 120)
    statuses = Counter(r.status for r in recs.values())
    attempts = Counter(r.attempts for r in recs.values())
    print(f"\nafter the SIGKILL: {dict(statuses)}; attempts {dict(attempts)}")
    for rec in recs.values():
        if rec.attempts == 1:
            assert rec.status == "succeeded", rec
        else:  # the run the kill interrupted: ran again, or ended failed naming the worker
            assert rec.status == "succeeded" or "worker" in (rec.error and rec.error.message or "")
    assert statuses["succeeded"] >= 9
    # one run slot: only the run the kill interrupted was claimed twice, every other once
    # (a run that ended just before the kill may be delivered again, and skipped by claim)
    assert sum(r.attempts > 1 for r in recs.values()) <= 1, attempts
    assert all(q.done_count(j) >= 1 for j in runs)
    assert q.client.fairness()["waiting"] == 0


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.timeout(240)
def test_user_cap_holds_runs_in_flight(make_stack: Any) -> None:
    """STUDIO_QUEUE_RUN_USER_SLOTS=2 on 4 run slots: never more than 2 of one user's runs
    running at once (the store's started/finished times); more wait, none is refused."""
    q = make_stack(code_concurrency=2, queue_test_slots=0, queue_run_user_slots=2)
    q.start_worker("w1", 2)
    q.start_worker("w2", 2)
    ann = [q.client.submit(sleeper(0.4, "a"), "python", {}, user="ann") for _ in range(12)]
    bob = [q.client.submit(sleeper(0.4, "b"), "python", {}, user="bob") for _ in range(6)]
    held = q.client.where(ann[-1])
    assert held is not None and held.users_ahead is None, "ann is at her cap"
    recs = q.wait_all([*ann, *bob], 180)
    assert all(r.status == "succeeded" for r in recs.values())
    peaks = {
        "ann": _peak([recs[j] for j in ann]),
        "bob": _peak([recs[j] for j in bob]),
        "all": _peak(list(recs.values())),
    }
    print(f"\nmost running at once: {peaks}")
    assert peaks["ann"] <= 2 and peaks["bob"] <= 2, peaks
    assert q.client.fairness()["released_not_ended"] == 0
