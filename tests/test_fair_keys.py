"""Concurrency keys (worker.fair): the share key (STUDIO_QUEUE_RUN_SHARE_KEY) and the caps per
tenant and per workflow (STUDIO_QUEUE_RUN_TENANT_SLOTS, _WORKFLOW_SLOTS). The script on a real
redis-server, the submit's checks, the run's view; then the whole path with real workers
and the engine: tenants behind a flood, a workflow's cap under four submitting processes
and a SIGKILLed worker. Timing is printed, never asserted (bench/fair.py measures it)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import pytest

from testkit.fair import SIGKILL_CAP_STACK, CapWatch, announce, drain, kill_one_running, released
from tests.snippets import TRIVIAL

# --- the script, on a real redis-server ------------------------------------------------------


def _message(job_id: str) -> str:
    return json.dumps({"headers": {"id": job_id}, "body": job_id})


def _queue(r: Any, **kw: Any) -> Any:
    from worker.fair import FairQueue

    return FairQueue(r, kw.pop("cap", 0), **kw)


@pytest.mark.redis
def test_a_workflow_at_its_cap_waits_in_order_and_its_user_goes_on(redis_server: Any) -> None:
    """Workflow cap 2: a user's runaway workflow holds 2 slots, the user's other workflow
    and other users go on; the held runs wait in order and go as the workflow's runs end."""
    import redis

    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    fair = _queue(r, workflow_cap=2)
    announce(r, 8)
    for i in range(5):
        fair.enqueue(f"w{i}", "ann", _message(f"w{i}"), tenant="acme", workflow="big")
    fair.enqueue("o0", "ann", _message("o0"), tenant="acme", workflow="small")
    fair.enqueue("b0", "bob", _message("b0"), tenant="acme", workflow="big")  # same workflow
    fair.enqueue("c0", "cy", _message("c0"), tenant="beta", workflow="big")  # another tenant's
    assert released(r) == ["w0", "w1", "o0", "c0"], "acme/big is at its cap of 2"
    where = fair.where("w2")
    assert where is not None and where.cap_kind == "workflow" and where.users_ahead is None
    assert (where.cap, where.cap_held, where.position) == (2, 2, 0)
    assert where.as_dict()["held_by"] == "workflow_cap"
    assert fair.where("b0") is not None and fair.where("b0").cap_kind == "workflow"  # type: ignore[union-attr]
    r.delete("code.run")
    assert fair.release() == 0, "the cap holds with room in code.run"
    assert fair.ended(["o0", "c0"]) == 0, "other keys' ends free no slot of acme/big"
    # the freed slot: bob's turn first (ann took 3 turns), then ann's runs in their order
    assert fair.ended(["w0"]) == 1 and released(r) == ["b0"], "bob's turn"
    assert fair.ended(["w0"]) == 0, "an end counts once"
    assert fair.ended(["w1", "b0"]) == 2 and released(r) == ["b0", "w2", "w3"]
    assert r.hget("studio:fair:held_count", "w:acme/big") == "2"
    assert fair.forget(["w4"]) == 1
    assert fair.ended(["w2", "w3"]) == 0 and fair.stats().waiting == 0
    assert r.hgetall("studio:fair:held_count") == {}
    assert r.hlen("studio:fair:parked") == 0 and r.hlen("studio:fair:parked_kinds") == 0
    r.close()


@pytest.mark.redis
def test_share_key_tenant_gives_each_tenant_one_turn(redis_server: Any) -> None:
    """STUDIO_QUEUE_RUN_SHARE_KEY=tenant: a tenant's many users take one turn between them;
    tenant/user: each user of each tenant; user (the default): each user."""
    import redis

    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    orders = {}
    for share in ("tenant", "tenant/user", "user"):
        r.flushdb()
        fair = _queue(r, share=share)
        announce(r, 1)
        fair.enqueue("x", "", _message("x"))  # fills code.run's room (FAIR_MIN_AHEAD is 2)
        fair.enqueue("y", "", _message("y"))
        for i in range(3):  # acme: 3 users, 2 runs each, oldest first
            for u in ("a1", "a2", "a3"):
                fair.enqueue(f"{u}-{i}", u, _message(f"{u}-{i}"), tenant="acme")
        for i in range(3):
            fair.enqueue(f"b-{i}", "b1", _message(f"b-{i}"), tenant="beta")
        r.delete("code.run")
        orders[share] = drain(r, fair, 6)
    assert orders["tenant"] == ["a1-0", "b-0", "a2-0", "b-1", "a3-0", "b-2"]
    assert (
        orders["tenant/user"] == orders["user"] == ["a1-0", "a2-0", "a3-0", "b-0", "a1-1", "a2-1"]
    )
    r.close()


@pytest.mark.redis
def test_a_tenant_cap_holds_all_its_users(redis_server: Any) -> None:
    import redis

    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    fair = _queue(r, tenant_cap=3)
    announce(r, 10)
    for i in range(3):
        for u in ("a1", "a2"):
            fair.enqueue(f"{u}-{i}", u, _message(f"{u}-{i}"), tenant="acme")
    fair.enqueue("b-0", "b1", _message("b-0"), tenant="beta")
    fair.enqueue("n-0", "nobody", _message("n-0"))  # no tenant: no tenant cap
    assert sorted(released(r)) == ["a1-0", "a1-1", "a2-0", "b-0", "n-0"]
    where = fair.where("a2-1")
    assert where is not None and where.cap_kind == "tenant" and where.cap_held == 3
    assert fair.ended(["b-0", "n-0"]) == 0, "other tenants' ends free none of acme's"
    assert fair.ended(["a1-0"]) == 1 and released(r)[-1] in ("a1-2", "a2-1")
    assert r.hget("studio:fair:held_count", "t:acme") == "3"
    r.close()


@pytest.mark.redis
def test_caps_set_to_zero_free_the_parked_lanes(redis_server: Any) -> None:
    """A process whose caps are off (0) releases lanes another parked at a cap: turning a
    cap off never leaves runs parked."""
    import redis

    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    announce(r, 8)
    capped = _queue(r, workflow_cap=1)
    for i in range(3):
        capped.enqueue(f"w{i}", "ann", _message(f"w{i}"), workflow="wf")
    assert released(r) == ["w0"]
    assert _queue(r).release() == 2 and released(r) == ["w0", "w1", "w2"]
    assert r.hlen("studio:fair:parked") == 0
    r.close()


def test_keys_are_checked() -> None:
    from executor.errors import CodeInvalid
    from executor.keys import check_key
    from worker.fair import lane_of

    assert check_key("tenant", None) == "" == check_key("tenant", "")
    assert check_key("workflow", "wf-1.a_b:c") == "wf-1.a_b:c"
    assert check_key("tenant", "x" * 64) == "x" * 64
    for bad in ("x" * 65, "-x", "a/b", "a b", "é", "a\nb"):
        with pytest.raises(CodeInvalid) as e:
            check_key("tenant", bad)
        assert e.value.code == "CODE_INVALID" and "leave tenant out" in e.value.message
    assert lane_of("ann") == "ann" and lane_of("ann", "acme", "") == '["acme","ann",""]'


def test_cli_submit_checks_the_keys(tmp_path: Any) -> None:
    """``studio-code submit --workflow`` with a key that is not one: refused before any
    connection, CODE_INVALID with the sentence."""
    from testkit.stack import base_env
    from tests.conftest import run_cli

    path = tmp_path / "node.py"
    path.write_text(TRIVIAL)
    # this checkout first on PYTHONPATH (the console script is the venv's)
    env = {
        **base_env(),
        "STUDIO_ENABLE_CODE_NODES": "1",
        "STUDIO_REDIS_URL": "redis://127.0.0.1:1/0",
    }
    proc = run_cli("submit", str(path), "--tenant", "acme", "--workflow", "a b", env=env)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout + proc.stderr
    out = json.loads(lines[0])
    assert proc.returncode == 1 and out["error"]["code"] == "CODE_INVALID", out
    assert "--workflow 'a b' is not a key" in out["error"]["message"]


@pytest.mark.redis
def test_api_checks_the_keys_and_says_a_run_waits_at_its_workflow_cap(
    redis_server: Any, tmp_path: Any, make_settings: Any
) -> None:
    """POST /api/runs with a bad key: 400 CODE_INVALID with the sentence. A run held at its
    workflow's cap: GET /api/runs/{id} says so, with counts, naming no other user."""
    import httpx

    from api_client import CodeClient
    from api_client.http.app import create_app

    settings = make_settings(
        redis_url=redis_server.url,
        database_url=f"sqlite:///{tmp_path / 'keys.db'}",
        queue_require_worker=False,
        queue_run_workflow_slots=2,
    )
    with CodeClient(settings) as client:
        announce(client.redis, 8)  # a live worker of code.run (none consumes)
        app = create_app(settings, client=client)

        async def call(method: str, path: str, user: str, body: Any = None) -> Any:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as h:
                return await h.request(method, path, json=body, headers={"X-Studio-User": user})

        bad = asyncio.run(
            call("POST", "/api/runs", "ann", {"code": TRIVIAL, "tenant": "acme", "workflow": "a/b"})
        )
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["code"] == "CODE_INVALID"
        assert "workflow 'a/b' is not a key" in bad.json()["error"]["message"]
        body = {"code": TRIVIAL, "tenant": "acme", "workflow": "nightly"}
        ids = []
        for user in ("bob", "bob", "ann"):
            r = asyncio.run(call("POST", "/api/runs", user, body))
            assert r.status_code == 202, r.text
            ids.append(r.json()["job_id"])
        view = asyncio.run(call("GET", f"/api/runs/{ids[2]}", "ann")).json()
        waiting = view["waiting"]
        print(f"\n{waiting['reason']}")
        assert waiting["held_by"] == "workflow_cap" and waiting["users_ahead"] is None
        assert "behind its workflow's cap of 2" in waiting["reason"]
        assert "2 of its workflow's runs are in flight" in waiting["reason"]
        assert "bob" not in json.dumps(view), "another user is never named"
        assert client.where(ids[1]) is None  # bob's two: released
        meta = client.fairness()
        assert (meta["share_key"], meta["workflow_slots"], meta["tenant_slots"]) == (
            "user",
            2,
            None,
        )
        with pytest.raises(Exception) as e:
            client.submit(TRIVIAL, "python", {}, user="ann", tenant="ac me")
        assert getattr(e.value, "code", None) == "CODE_INVALID"


# --- the whole path: real clients, real workers ----------------------------------------------


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tenants_runs_start_within_the_first_slots_behind_a_flood(make_stack: Any) -> None:
    """STUDIO_QUEUE_RUN_SHARE_KEY=tenant. Tenant flood queues FLOOD runs from 30 users (by
    user, it would take 30 turns in 32); then tenants two and three 10 runs each: every one
    of theirs starts within a bound from the slot count, not behind the flood."""
    q = make_stack(code_concurrency=2, queue_test_slots=0, queue_run_share_key="tenant")
    q.start_worker("w1", 2)
    q.start_worker("w2", 2)
    slots = 4
    flood = [
        q.client.submit(TRIVIAL, "python", {"n": i}, user=f"f{i % 30}", tenant="flood")
        for i in range(FLOOD)
    ]
    time.sleep(1.0)  # the flood is under way
    others: dict[str, list[str]] = {"two": [], "three": []}
    for i in range(10):
        for tenant, ids in others.items():
            ids.append(q.client.submit(TRIVIAL, "python", {"n": i}, user="u1", tenant=tenant))
    everyone = [*flood, *others["two"], *others["three"]]
    recs = q.wait_all(everyone, 800)
    assert all(r.status == "succeeded" for r in recs.values()), Counter(
        r.status for r in recs.values()
    )
    assert [recs[j].output for j in flood] == [2 * i for i in range(FLOOD)]
    for tenant, ids in others.items():
        first, last = recs[ids[0]], max((recs[j] for j in ids), key=lambda r: r.started_at)
        ahead_first = _started_between(recs, flood, first.queued_at, first.started_at)
        ahead_last = _started_between(recs, flood, first.queued_at, last.started_at)
        print(
            f"\ntenant {tenant}: first run started behind {ahead_first} of the flood's runs, "
            f"its 10th behind {ahead_last} ({FLOOD} flooded; by FIFO ~{FLOOD - 10})"
        )
        # what was in code.run and running when it came (2 x slots + FAIR_MIN_AHEAD), then
        # one flood turn per turn of its own (10)
        assert ahead_first <= 2 * slots + 2, (tenant, ahead_first)
        assert ahead_last <= 2 * slots + 2 + 10, (tenant, ahead_last)
    assert q.client.fairness()["waiting"] == 0


#: the flooding tenant's runs (the issue's 300; each a trivial run on 4 slots)
FLOOD = 300


def _started_between(recs: dict[str, Any], ids: list[str], after: Any, before: Any) -> int:
    return sum(1 for j in ids if recs[j].started_at and after < recs[j].started_at < before)


#: a client process: submits its share of runs, all at once after the go file appears
SUBMITTER = """
import json, os, sys, time
from api_client import CodeClient
from executor.settings import load_settings
from tests.snippets import sleeper
n, go = int(sys.argv[1]), sys.argv[2]
with CodeClient(load_settings()) as c:
    c.submit(sleeper(0.01, "warm"), "python", {}, user="warm", tenant="warm")
    while not os.path.exists(go):
        time.sleep(0.005)
    ids = [c.submit(sleeper(0.6, "wf"), "python", {}, user=f"p{os.getpid()}", tenant="acme",
                    workflow="nightly") for _ in range(n)]
print(json.dumps(ids))
"""


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.timeout(400)
def test_workflow_cap_holds_under_four_submitters_and_a_sigkill(
    make_stack: Any, tmp_path: Any, docker_client: Any
) -> None:
    """STUDIO_QUEUE_RUN_WORKFLOW_SLOTS=2 on 6 run slots: 4 client processes submit a
    workflow's runs at once, as 4 users of one tenant; a worker is SIGKILLed while it runs
    one. Sampled every 50 ms, the workflow's runs released and not ended (Redis) and running
    (the run store) never pass 2; the killed run's slot comes back and every run ends."""
    q = make_stack(**SIGKILL_CAP_STACK)
    w1 = q.start_worker("w1", 3)
    q.start_worker("w2", 3)
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SUBMITTER, "6", str(go)],
            env=q.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    ids: list[str] = []
    with CapWatch(q.client, "w:acme/nightly", ids) as watch:
        time.sleep(3.0)  # the submitters are connected (each sent a warm-up run)
        go.touch()
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            ids += json.loads(out)
        assert len(set(ids)) == 24
        last_waits = q.client.where(ids[-1])  # asserted below, after the samples
        # a run of w1's holds a slot: SIGKILL w1 (main process and pool) while it runs
        killed = kill_one_running(q, w1, ids)
        recs = q.wait_all(ids, 300)
    peak_held, peak_running = watch.peaks
    print(
        f"\n{watch.account(recs)}; killed {killed}: {recs[killed].status} "
        f"(attempts {recs[killed].attempts})"
    )
    assert peak_held <= 2 and peak_running <= 2, (peak_held, peak_running)
    assert peak_held == 2, "the cap was reached (the test saw it hold)"
    assert last_waits is not None and last_waits.cap_kind == "workflow", last_waits
    # the runs the kill interrupted (at most the cap's 2 ran on w1): ran again, or ended
    # failed naming the worker; every other run succeeded
    lost = [r for r in recs.values() if r.status != "succeeded"]
    assert len(lost) <= 2 and recs[killed] in lost or recs[killed].attempts > 1, lost
    for rec in lost:
        assert rec.error is not None and "worker" in rec.error.message, rec.error
    # the killed run's slot came back: every run after it ran, and none is held now
    assert q.client.redis.hget("studio:fair:held_count", "w:acme/nightly") is None
    assert q.client.fairness()["waiting"] == 0
