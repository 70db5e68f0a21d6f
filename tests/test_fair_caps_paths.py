"""The caps of the concurrency keys (worker.fair) on every path a run's message takes, not only
the submit: a retry's next attempt (worker.upkeep.retry_due), a lost message the queued sweep
sends again (worker.upkeep.queued), a worker group's own queue (code.run.NAME), many API
processes submitting at once, and a Redis Sentinel failover. The script on a real
redis-server first; then real workers, the engine and Redis, a key's runs sampled every
50 ms (testkit.fair.CapWatch): never more than its cap released nor running, every run ends
once, and its slots come back. Each test prints its accounting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from testkit.fair import SIGKILL_CAP_STACK, CapWatch, announce, kill_one_running, released
from testkit.stack import BIG_WORKER
from tests.snippets import sleeper

SLOW_RAISE = (
    "import time\n\ndef main(state):\n    time.sleep(state['s'])\n    raise ValueError('boom')\n"
)
#: a retry on CODE_ERROR, 3 attempts, 0.3 s apart
RETRY = {"max_attempts": 3, "on": ["CODE_ERROR"], "backoff": {"initial_s": 0.3, "jitter": 0}}
#: workflow cap 2, no worker needed at submit, lost messages looked for after 2 s, retries'
#: next attempts sent within 0.2 s of their delay (make_stack's settings)
RESEND_STACK: dict[str, Any] = {
    "code_concurrency": 3,
    "queue_test_slots": 0,
    "queue_run_workflow_slots": 2,
    "queue_require_worker": False,
    "queue_lost_after_s": 2,
    "queue_reap_interval_s": 1,
    "queue_retry_tick_s": 0.2,
}


def _message(job_id: str) -> str:
    return json.dumps({"headers": {"id": job_id}, "body": job_id})


# --- the script, on a real redis-server ------------------------------------------------------


@pytest.mark.redis
def test_a_message_sent_again_is_admitted_once_at_its_keys_caps(redis_server: Any) -> None:
    """Workflow cap 2. A retry's wait (``pause``) frees the slot and keeps the lane; its next
    attempt (``again``, naming only the user) waits on that lane at the cap; a job holding its
    slot whose message is sent again goes straight to code.run, counted once; a job waiting
    on its lane sent again changes nothing."""
    import redis

    from worker.fair import FairQueue

    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    fair = FairQueue(r, 0, workflow_cap=2)
    announce(r, 8)
    for i in range(3):
        fair.enqueue(f"w{i}", "ann", _message(f"w{i}"), tenant="acme", workflow="wf")
    assert released(r) == ["w0", "w1"] and r.hget("studio:fair:held_count", "w:acme/wf") == "2"
    # w0's message was lost after its release (it holds its slot): back in code.run, once
    r.delete("code.run")
    fair.enqueue("w0", "ann", _message("w0"), again=True)
    assert released(r) == ["w0"], "straight back: it holds its slot"
    assert r.hget("studio:fair:held_count", "w:acme/wf") == "2", "counted once"
    fair.enqueue("w2", "ann", _message("w2"), again=True)  # waits on its lane: nothing changes
    assert fair.stats().waiting == 1 and released(r) == ["w0"]
    # w1's attempt ended for a retry: its slot frees (w2 goes), its lane is kept
    r.delete("code.run")
    assert fair.pause(["w1"]) == 1 and released(r) == ["w2"]
    assert r.hget("studio:fair:again", "w1") == '["acme","ann","wf"]'
    # its next attempt, sent knowing only its user, waits on its workflow's lane at the cap
    fair.enqueue("w1", "ann", _message("w1"), again=True)
    where = fair.where("w1")
    assert where is not None and where.cap_kind == "workflow", where
    assert r.hget("studio:fair:again", "w1") is None
    assert fair.ended(["w0"]) == 1 and released(r) == ["w2", "w1"]
    assert r.hget("studio:fair:held_count", "w:acme/wf") == "2"
    # a job cancelled during its retry's delay: its kept lane goes with forget
    fair.pause(["w1"])
    assert fair.forget(["w1"]) == 0 and r.hlen("studio:fair:again") == 0
    fair.ended(["w2"])
    assert r.hgetall("studio:fair:held_count") == {} and r.hlen("studio:fair:held") == 0
    r.close()


@pytest.mark.redis
def test_a_worker_group_has_its_own_lanes_and_caps(redis_server: Any) -> None:
    """Group big's workflow runs wait in its own fair state and go to code.run.big, up to its
    workers' slots and its keys' caps; the default group's state is untouched."""
    import redis

    from worker.fair import FairQueue
    from worker.upkeep.heartbeat import Heartbeat

    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    hb = Heartbeat(redis_server.url, "big@test", {"code.run.big": 4}, interval_s=60, ttl_s=60)
    hb.beat()
    hb.redis.close()
    big = FairQueue(r, 0, workflow_cap=2, group="big")
    for i in range(4):
        big.enqueue(f"b{i}", "ann", _message(f"b{i}"), workflow="wf")
    assert [json.loads(m)["headers"]["id"] for m in reversed(r.lrange("code.run.big", 0, -1))] == [
        "b0",
        "b1",
    ]
    assert r.llen("code.run") == 0 and r.hlen("studio:fair:held") == 0
    assert r.hget("studio:fair:g:big:held_count", "w:/wf") == "2"
    assert big.where("b2").cap_kind == "workflow"  # type: ignore[union-attr]
    assert big.where("b2").as_dict()["queue"] == "code.run.big"  # type: ignore[union-attr]
    assert FairQueue(r, 0, workflow_cap=2).where("b2") is None, "not the default group's"
    r.delete("code.run.big")
    assert big.ended(["b0", "b1"]) == 2 and r.llen("code.run.big") == 2
    r.close()


# --- real workers, the engine, Redis ---------------------------------------------------------


def _submit_nightly(q: Any, ids: list[str], n: int, *, users: int, **more: Any) -> None:
    """``n`` runs of acme's workflow nightly (half a second each) by ``users`` users, their
    ids appended to ``ids`` as they are made."""
    for i in range(n):
        ids.append(
            q.client.submit(
                sleeper(0.5, "ok"),
                "python",
                {},
                user=f"u{i % users}",
                tenant="acme",
                workflow="nightly",
                **more,
            )
        )


def _cap_held_retries_ended(watch: CapWatch, recs: dict[str, Any], failing: list[str]) -> None:
    """The workflow cap of 2 held and was reached; the ``failing`` runs failed after 3
    attempts, the others succeeded at their first."""
    held, running = watch.peaks
    assert held <= 2 and running <= 2, watch.account(recs)
    assert held == 2, "the cap was reached (the test saw it hold)"
    for j, rec in recs.items():
        want = ("failed", 3) if j in failing else ("succeeded", 1)
        assert (str(rec.status), max(1, len(rec.history))) == want, (j, rec)


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.timeout(600)
def test_workflow_cap_holds_through_retries_and_sweep_resends(make_stack: Any) -> None:
    """STUDIO_QUEUE_RUN_WORKFLOW_SLOTS=2. 10 runs of one workflow, 4 of them failing on every
    attempt with a retry policy of 3 attempts (8 next attempts sent by the retry sweep); no
    worker yet, so 2 are released and their messages are then lost (deleted from code.run:
    the queued sweep sends them again). Then 2 workers of 3 slots: sampled every 50 ms, the
    workflow never has more than 2 runs released nor running; every run ends once; the
    slots come back."""
    q = make_stack(**RESEND_STACK)
    ids: list[str] = []
    failing: list[str] = []
    with CapWatch(q.client, "w:acme/nightly", ids) as watch:
        for i in range(10):
            if i % 5 in (1, 3):
                job = q.client.submit(
                    SLOW_RAISE,
                    "python",
                    {"s": 0.3},
                    user=f"u{i % 3}",
                    tenant="acme",
                    workflow="nightly",
                    retry=RETRY,
                )
                failing.append(job)
            else:
                job = q.client.submit(
                    sleeper(0.4, "ok"),
                    "python",
                    {},
                    user=f"u{i % 3}",
                    tenant="acme",
                    workflow="nightly",
                )
            ids.append(job)
        lost = [json.loads(m)["headers"]["id"] for m in q.client.redis.lrange("code.run", 0, -1)]
        assert len(lost) == 2, lost
        q.client.redis.delete("code.run")  # lost after their release: they hold their slots
        q.start_worker("w1", 3)
        q.start_worker("w2", 3)
        recs = q.wait_all(ids, 300)
    print(f"\n{watch.account(recs)}; lost messages resent: {lost}")
    _cap_held_retries_ended(watch, recs, failing)
    assert all(recs[j].finished for j in lost)
    r = q.client.redis
    assert r.hget("studio:fair:held_count", "w:acme/nightly") is None, "every slot came back"
    assert r.hlen("studio:fair:held") == 0 and r.hlen("studio:fair:again") == 0


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.timeout(600)
def test_a_run_whose_fair_state_redis_lost_returns_to_its_workflow_lane(make_stack: Any) -> None:
    """STUDIO_QUEUE_RUN_WORKFLOW_SLOTS=2, no user cap. 8 runs of acme's workflow nightly by 4
    users, 2 of them failing with a retry policy of 3 attempts, submitted with no worker up:
    then Redis loses their fair state entirely (a failover losing unreplicated writes: every
    ``studio:fair:*`` key, the lanes, the released runs' slots and their messages in
    code.run), and while they run a thread drops every kept lane of a retry
    (``studio:fair:again``) as soon as it is written. The queued sweep sends the 8 again and
    the retry sweep sends the next attempts, each knowing the run's tenant and workflow from
    the run store only: sampled every 50 ms, never more than 2 of the workflow's runs
    released nor running; every run ends once; the slots come back."""
    import threading

    q = make_stack(**RESEND_STACK)
    r = q.client.redis
    ids: list[str] = []
    failing: list[str] = []
    for i in range(8):
        more: dict[str, Any] = {"retry": RETRY} if i in (2, 5) else {}
        code, state = (SLOW_RAISE, {"s": 0.3}) if more else (sleeper(0.4, "ok"), {})
        job = q.client.submit(
            code, "python", state, user=f"u{i % 4}", tenant="acme", workflow="nightly", **more
        )
        (failing if more else []).append(job)
        ids.append(job)
    assert r.llen("code.run") == 2 and r.hget("studio:fair:jobs", ids[-1]) is not None
    # the failover: every fair key and message gone (the run store still holds the 8)
    lost = [k for k in r.scan_iter("studio:fair:*")]
    assert r.delete("code.run", *lost) >= 3
    dropped: list[int] = []
    stop = threading.Event()

    def drop_kept_lanes() -> None:
        while not stop.wait(0.01):
            dropped.append(int(r.delete("studio:fair:again")))

    dropper = threading.Thread(target=drop_kept_lanes, daemon=True)
    dropper.start()
    try:
        with CapWatch(q.client, "w:acme/nightly", ids) as watch:
            q.start_worker("w1", 3)
            q.start_worker("w2", 3)
            recs = q.wait_all(ids, 300)
    finally:
        stop.set()
        dropper.join(5)
    print(f"\n{watch.account(recs)}; kept lanes dropped: {sum(dropped)}")
    _cap_held_retries_ended(watch, recs, failing)
    assert all(q.done_count(j) == 1 for j in ids), "each ended once"
    assert r.hget("studio:fair:held_count", "w:acme/nightly") is None, "every slot came back"
    assert r.hlen("studio:fair:held") == 0


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.timeout(600)
def test_workflow_cap_holds_on_a_big_group_worker(make_stack: Any) -> None:
    """A worker of group big (`studio-code worker --group big`, 3 slots) and the workflow cap
    of 2: 8 runs of one workflow sent to group big wait on the group's own lanes; sampled
    every 50 ms, never more than 2 released nor running; every run ends once on the big
    worker; the group's slots come back."""
    q = make_stack(
        worker_groups="big:1g:1",
        code_concurrency=3,
        queue_test_slots=0,
        queue_run_workflow_slots=2,
    )
    q.start_worker("small", 1)
    q.start_worker("big", 3, **BIG_WORKER)
    ids: list[str] = []
    with CapWatch(q.client, "w:acme/nightly", ids, held_key="studio:fair:g:big:held_count") as w:
        _submit_nightly(q, ids, 8, users=2, group="big")
        waits = q.client.why_waiting(q.client.store.get(ids[-1], inputs=False))
        recs = q.wait_all(ids, 300)
    print(f"\n{w.account(recs)}")
    held, running = w.peaks
    assert held <= 2 and running <= 2, w.account(recs)
    assert held == 2, "the cap was reached (the test saw it hold)"
    assert all(str(r.status) == "succeeded" for r in recs.values()), w.account(recs)
    assert {(r.worker or "").split("@")[0] for r in recs.values()} == {"big"}
    assert waits is not None and "workflow" in json.dumps(waits.as_dict()), waits
    # a run's row is finished before its done notice and its slot's release, which go in
    # one transaction after it (a loaded CI run read the count between the two)
    from testkit.processes import wait_for

    wait_for(lambda: all(q.done_count(j) == 1 for j in ids), 60, "each run's done notice")
    r = q.client.redis
    assert r.hget("studio:fair:g:big:held_count", "w:acme/nightly") is None
    assert r.hlen("studio:fair:held") == 0, "the default group's state was not used"


def _ended_once(q: Any, recs: dict[str, Any], killed: str | None = None) -> None:
    """Every run succeeded but those a SIGKILL interrupted (at most the cap's 2, each ended
    failed naming its worker); each ended once (one done notice); the key's slots are back."""
    lost = [j for j, r in recs.items() if str(r.status) != "succeeded"]
    assert len(lost) <= 2 and (killed is None or killed in lost or recs[killed].attempts > 1)
    for j in lost:
        assert recs[j].error is not None and "worker" in recs[j].error.message, recs[j].error
    assert all(q.done_count(j) == 1 for j in recs if j not in lost), "each ended once"


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.timeout(600)
def test_workflow_cap_holds_under_four_api_processes_and_a_sigkill(
    make_stack: Any, tmp_path: Path
) -> None:
    """4 API processes (`studio-code serve`, each on its own port) take POST /api/runs at
    once, 6 runs of one workflow each from 4 users of one tenant; a worker is SIGKILLed while
    it runs one. Sampled every 50 ms: never more than 2 of the workflow's runs released nor
    running; every run ends once; the killed run's slot comes back."""
    import threading

    import httpx

    from testkit.api import ApiServer

    q = make_stack(**SIGKILL_CAP_STACK)
    w1 = q.start_worker("w1", 3)
    q.start_worker("w2", 3)
    apis = [ApiServer(q.env(), tmp_path / f"api{i}.log") for i in range(4)]
    ids: list[str] = []
    go = threading.Barrier(4)
    errors: list[str] = []

    def submit(api: Any, n: int) -> None:
        with httpx.Client(base_url=api.base, timeout=60) as http:
            go.wait()
            for _ in range(n):
                r = http.post(
                    "/api/runs",
                    json={"code": sleeper(0.6, "wf"), "tenant": "acme", "workflow": "nightly"},
                    headers=q.as_user(f"p{api.port}"),
                )
                if r.status_code != 202:
                    errors.append(r.text)
                else:
                    ids.append(r.json()["job_id"])

    try:
        with CapWatch(q.client, "w:acme/nightly", ids) as watch:
            threads = [threading.Thread(target=submit, args=(api, 6)) for api in apis]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert not errors and len(set(ids)) == 24, errors
            last_waits = q.client.where(ids[-1])
            killed = kill_one_running(q, w1, ids)
            recs = q.wait_all(ids, 300)
    finally:
        for api in apis:
            api.stop()
    print(f"\n{watch.account(recs)}; killed {killed}: {recs[killed].status}")
    held, running = watch.peaks
    assert held <= 2 and running <= 2, watch.account(recs)
    assert held == 2, "the cap was reached (the test saw it hold)"
    assert last_waits is not None and last_waits.cap_kind == "workflow", last_waits
    _ended_once(q, recs, killed)
    assert q.client.redis.hget("studio:fair:held_count", "w:acme/nightly") is None


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.timeout(900)
def test_workflow_cap_holds_across_a_sentinel_failover(
    sqlite_url: str, tmp_path: Path, python_image: str
) -> None:
    """A primary, a replica and three sentinels; 20 runs of one workflow (cap 2) on 2 workers
    of 3 slots; the primary SIGKILLed once a few ended. Sampled every 50 ms (Redis's side
    unknown while no primary answers; the run store's always read): never more than 2 of
    the workflow's runs released nor running; every run ends once; its slots come back on
    the new primary."""
    from testkit.processes import wait_for
    from testkit.sentinel import start_sentinels
    from testkit.stack import Stack

    with start_sentinels(tmp_path) as sentinels:
        q = Stack(
            tmp_path,
            redis_url=sentinels.url,
            database_url=sqlite_url,
            code_image=python_image,
            redis_sentinel_master="studio",
            queue_lost_after_s=10,
            queue_heartbeat_interval_s=1,
            code_concurrency=3,
            queue_test_slots=0,
            queue_run_workflow_slots=2,
        )
        try:
            q.start_worker("w1", 3)
            q.start_worker("w2", 3)
            ids: list[str] = []
            with CapWatch(q.client, "w:acme/nightly", ids) as watch:
                _submit_nightly(q, ids, 20, users=4)
                wait_for(
                    lambda: sum(s.finished for s in q.client.store.statuses(ids).values()) >= 4,
                    120,
                    "4 runs ended",
                    0.1,
                )
                dead = sentinels.kill_primary()
                sentinels.wait_master(sentinels.ports[sentinels.other(dead)], 60)
                recs = q.wait_all(ids, 600)
            print(f"\n{watch.account(recs)}; primary {dead} killed")
            held, running = watch.peaks
            assert held <= 2 and running <= 2, watch.account(recs)
            assert all(str(r.status) == "succeeded" for r in recs.values()), watch.account(recs)
            # ended once: the store's finish is one conditional UPDATE (a done notice may
            # have been lost with the old primary, so none is counted here)
            assert all(r.finished_at is not None for r in recs.values())
            wait_for(
                lambda: q.client.redis.hget("studio:fair:held_count", "w:acme/nightly") is None,
                30,
                "the workflow's slots back on the new primary",
            )
        finally:
            q.stop()
