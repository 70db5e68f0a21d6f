"""Why a queued run waits (api_client.why_waiting): one test per reason, each on a real
Redis with the real heartbeat or real Celery workers, read through the client, the CLI and
GET /api/runs/{id}: no live worker, paused workers, its user's cap, its user's turn, its
place in its queue (workflow runs and editor test calls), with an estimate from the
queue's recent pace."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.processes import wait_for
from testkit.stack import FAST_SETTINGS, Stack, client_for
from testkit.worker import gated_heartbeat
from tests.conftest import run_cli
from tests.snippets import SLEEP_CODE, TRIVIAL

pytestmark = [pytest.mark.redis]


def _db(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'runs.db'}"


def _why(client: Any, job_id: str) -> Any:
    why = client.why_waiting(client.status(job_id))
    assert why is not None, client.status(job_id)
    return why


def test_no_live_worker_is_said_first(
    redis_server: Any, tmp_path: Path, make_settings: Any
) -> None:
    """Queued while no worker serves its queue (accepted with STUDIO_QUEUE_REQUIRE_WORKER
    off, as after every worker stopped): both queues say so, and what to do."""
    with client_for(
        make_settings, redis_server.url, _db(tmp_path), queue_require_worker=False
    ) as client:
        for kind, queue in (("run", "code.run"), ("test", "code.test")):
            job = client.submit(TRIVIAL, "python", {}, user="ann", kind=kind)
            why = _why(client, job)
            assert (why.held_by, why.queue, why.workers) == ("no_worker", queue, 0)
            assert f"No live worker serves {queue}" in why.reason
            assert "studio-code worker" in why.reason
        # the CLI's status says the same
        done = run_cli("status", job, env={**_env(client)})
        assert done.returncode == 0, done.stdout + done.stderr
        assert json.loads(done.stdout)["waiting"]["held_by"] == "no_worker"


def _env(client: Any) -> dict[str, str]:
    s = client.settings
    return {
        "STUDIO_ENABLE_CODE_NODES": "1",
        "STUDIO_REDIS_URL": s.redis_url,
        "STUDIO_DATABASE_URL": s.database_url,
        "STUDIO_CODE_RUNTIME": "subprocess",
        "STUDIO_CODE_LANGUAGES": "python",
    }


def test_paused_workers_are_named_with_their_reasons(
    redis_server: Any, tmp_path: Path, make_settings: Any
) -> None:
    """The heartbeat itself (as test_control's paused worker) announces a worker paused
    with a reason: a run queued meanwhile says every worker of its queue is paused, and
    why; once it serves again, the reason is no longer the pause."""
    reason: list[str | None] = ["the run store at sqlite:///x is not reachable"]
    with gated_heartbeat(redis_server.url, reason, slots=2):
        with client_for(
            make_settings,
            redis_server.url,
            _db(tmp_path),
            queue_require_worker=False,
            queue_run_fairness="off",
        ) as client:
            wait_for(lambda: client.live_workers()["code.run"], 5, "the heartbeat")
            job = client.submit(TRIVIAL, "python", {}, user="ann")
            why = _why(client, job)
            assert why.held_by == "workers_paused" and why.workers == 0
            assert why.paused == [
                {
                    "nodename": "gated@test",
                    "reason": "the run store at sqlite:///x is not reachable",
                }
            ]
            assert "gated@test: the run store" in why.reason
            reason[0] = None
            wait_for(lambda: client.live_workers()["code.run"][0].serving, 5, "serving")
            why = _why(client, job)  # nobody consumes: it waits in code.run, first
            assert (why.held_by, why.position, why.workers, why.slots) == ("queue", 0, 1, 2)


# --- real workers ----------------------------------------------------------------------------


@pytest.fixture
def stack(tmp_path: Path, redis_server: Any) -> Iterator[Any]:
    def make(**overrides: Any) -> Stack:
        s = Stack(tmp_path, redis_url=redis_server.url, **overrides)
        made.append(s)
        return s

    made: list[Stack] = []
    yield make
    for s in made:
        s.stop()


def test_a_run_behind_its_users_cap_says_so(stack: Any) -> None:
    s = stack(**FAST_SETTINGS, queue_run_fairness="users", queue_run_user_slots=1)
    s.start_worker("w", concurrency=3)
    first = s.client.submit(SLEEP_CODE, "python", {"s": 30}, user="ann")
    wait_for(lambda: s.client.status(first).status == "running", 30, "the first running")
    second = s.client.submit(SLEEP_CODE, "python", {"s": 30}, user="ann")
    why = _why(s.client, second)
    assert (why.held_by, why.position, why.users_ahead) == ("user_cap", 0, None)
    assert "STUDIO_QUEUE_RUN_USER_SLOTS" in why.reason
    for job in (first, second):
        s.client.cancel(job)


def test_a_run_waiting_for_its_users_turn_says_so(stack: Any) -> None:
    s = stack(**FAST_SETTINGS, queue_run_fairness="users")
    s.start_worker("w", concurrency=2)  # one slot of code.run
    ann = [s.client.submit(SLEEP_CODE, "python", {"s": 30}, user="ann") for _ in range(4)]
    bob = s.client.submit(SLEEP_CODE, "python", {"s": 30}, user="bob")
    wait_for(lambda: s.client.status(ann[0]).status == "running", 30, "ann's first running")
    why = _why(s.client, ann[-1])
    assert why.held_by == "fairness" and why.users_waiting == 2, why
    # its place on ann's list (ann's first runs were released to the one slot and its
    # prefetch), and bob's turn counted, never named
    assert why.position is not None and why.users_ahead is not None
    assert "2 users with runs waiting" in why.reason and "bob" not in why.reason
    for job in [*ann, bob]:
        s.client.cancel(job)


def test_runs_in_their_queue_say_their_place_and_an_estimate(stack: Any) -> None:
    """Fairness off, one slot: runs behind the running one say their place in code.run,
    one apart; with runs of the kind ended lately, an estimate. Editor test calls in
    code.test the same. Over HTTP too, as the editor reads it."""
    s = stack(**FAST_SETTINGS, queue_run_fairness="off")
    s.start_worker("w", concurrency=2)  # code.run: 1 slot, code.test: 1
    s.start_api()
    quick = [s.client.submit(TRIVIAL, "python", {"n": i}, user="ann") for i in range(3)]
    s.wait_all(quick, 60)
    for kind in ("run", "test"):
        jobs = [s.client.submit(SLEEP_CODE, "python", {"s": 30}, user="ann", kind=kind)]
        wait_for(lambda j=jobs[0]: s.client.status(j).status == "running", 30, "running")
        jobs += [
            s.client.submit(SLEEP_CODE, "python", {"s": 30}, user="ann", kind=kind)
            for _ in range(4)
        ]
        last, before = _why(s.client, jobs[-1]), _why(s.client, jobs[-2])
        assert last.held_by == before.held_by == "queue", (last, before)
        assert last.position == before.position + 1, (last, before)
        assert (last.workers, last.slots) == (1, 1)
        if kind == "run":  # three runs ended in the window: an estimate
            assert last.estimate_s is not None and last.estimate_s > 0
            assert f"{last.position} run(s) ahead" in last.reason
            r = s.http.get(f"/api/runs/{jobs[-1]}", headers=s.as_user("ann"))
            assert r.status_code == 200, r.text
            waiting = r.json()["waiting"]
            assert waiting["held_by"] == "queue" and waiting["position"] == last.position
            assert waiting["reason"] == last.reason
            # a long poll that ends before the run starts says why it waits the same way
            r = s.http.get(f"/api/runs/{jobs[-1]}?wait=0.2", headers=s.as_user("ann"))
            assert r.status_code == 200, r.text
            assert r.json()["waiting"] == waiting
        for job in jobs:
            s.client.cancel(job)
