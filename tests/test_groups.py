"""Worker groups (executor.groups, issue 42): a big node runs only on the big group's worker,
a group with no live worker is refused at submit naming it, and small nodes never wait
behind big ones. Real workers (``celery -A worker`` and ``studio-code worker --group big``),
the engine, Redis and the API. Below them, the choosing rule and the settings, with no
service at all."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from executor.errors import CodeInvalid, ErrorCode, RuntimeUnavailable
from executor.groups import DEFAULT_GROUP, Group, choose, groups_of, parse_groups, widest
from testkit.processes import wait_for
from testkit.stack import BIG_WORKER
from tests.snippets import READ_FIRST, TRIVIAL

GIB = 1024**3
MIB = 1024**2

#: the sandbox's memory limit, read from inside it, after ``s`` seconds of sleep
MEMORY_LIMIT = READ_FIRST + (
    "import time\n\n"
    "def main(state):\n"
    "    time.sleep(state.get('s', 0))\n"
    "    return read('/sys/fs/cgroup/memory.max',\n"
    "                '/sys/fs/cgroup/memory/memory.limit_in_bytes')\n"
)


# --- two groups on this machine ------------------------------------------------------------


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.timeout(300)
def test_a_big_node_runs_only_on_the_big_group(make_stack: Any, docker_client: Any) -> None:
    """Two groups: default (256m a slot, a worker of 2 slots) and big (1g, one worker of
    one slot, started as `studio-code worker --group big`). With no big worker live, a node
    asking 1 GiB is refused at submit (client and HTTP) naming the group and what it asks;
    once one is, it runs there (its worker, and the 1 GiB limit read inside its sandbox),
    while small nodes submitted behind two big ones all finish on the default worker before
    the second big one has even started."""
    q = make_stack(worker_groups="big:1g:1", code_concurrency=2)
    small_worker = q.start_worker("small", 2)
    q.start_api()

    # no big worker: refused at once, nothing stored
    with pytest.raises(RuntimeUnavailable) as refused:
        q.client.submit(MEMORY_LIMIT, "python", {}, memory="1g")
    assert refused.value.code is ErrorCode.RUNTIME_UNAVAILABLE
    assert "group 'big'" in refused.value.message, refused.value.message
    assert "1g of memory" in refused.value.message, refused.value.message
    assert "studio-code worker --group big" in refused.value.message
    r = q.http.post("/api/runs", json={"code": TRIVIAL, "group": "big"}, headers=q.as_user("ann"))
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "RUNTIME_UNAVAILABLE" and "group 'big'" in error["message"], error
    assert q.client.list_runs().runs == [], "a refused submit stores nothing"

    big_worker = q.start_worker("big", 1, **BIG_WORKER, code_prewarm=0)
    live = q.client.live_workers()
    # the default group's queues keep their names; the big group has its own
    assert [i.nodename for i in live["code.run"]] == [small_worker.node]
    announced = q.client.workers.live(["code.run.big"])["code.run.big"]
    assert [(i.nodename, i.group, i.memory_bytes, i.cpus) for i in announced] == [
        (big_worker.node, "big", GIB, 1.0)
    ]

    # two big nodes (the first holds the big worker's one slot until cancelled), then
    # small ones: every small one ends on the default worker while the second big one waits
    big1 = q.client.submit(MEMORY_LIMIT, "python", {"s": 120}, memory="1g", user="ann")
    wait_for(lambda: q.client.status(big1).status == "running", 90, "the first big node runs")
    big2 = q.client.submit(MEMORY_LIMIT, "python", {}, memory="1g", user="ann")
    smalls = [q.client.submit(MEMORY_LIMIT, "python", {}, user="bob") for _ in range(3)]
    done = q.wait_all(smalls, 120)
    for rec in done.values():
        assert rec.status == "succeeded", rec
        assert rec.worker.startswith(small_worker.node + ":"), rec.worker
        assert int(rec.output) == 256 * MIB  # STUDIO_CODE_MEMORY, the default group's
    assert q.client.status(big2).status == "queued", "the second big node waits its turn"
    assert q.client.status(big1).status == "running"
    # the API's /metrics: the backlog per group (KEDA scales each group on its own list)
    backlog = _backlog(q.http.get("/metrics").text)
    assert (backlog["code.run.big"], backlog["code.run"], backlog["code.test.big"]) == (1, 0, 0)
    # meta: the groups, what a slot holds, their live workers
    groups = q.http.get("/api/meta/runtime").json()["groups"]
    assert list(groups) == ["default", "big"]
    assert (groups["big"]["memory_bytes"], groups["big"]["cpus"]) == (GIB, 1.0)
    assert groups["big"]["queues"] == ["code.test.big", "code.run.big"]
    assert list(groups["big"]["workers"]) == [big_worker.node]
    assert groups["big"]["workers"][big_worker.node]["memory_bytes"] == GIB
    assert list(groups["default"]["workers"]) == [small_worker.node]
    assert groups["default"]["workers"][small_worker.node]["memory_bytes"] == 256 * MIB

    q.client.cancel(big1)
    rec = q.client.wait(big2, 120)
    assert rec.status == "succeeded", (rec, big_worker.tail())
    assert rec.worker.startswith(big_worker.node + ":"), rec.worker
    assert int(rec.output) == GIB, "the limit read inside the big node's sandbox"
    assert q.client.store.get(big2).worker_group == "big"
    assert q.client.status(big1).status == "cancelled"

    # the caller's choice: a small node sent to big runs there, over HTTP too (a test call)
    chosen = q.client.submit(MEMORY_LIMIT, "python", {}, group="big")
    rec = q.client.wait(chosen, 120)
    assert rec.worker.startswith(big_worker.node + ":") and int(rec.output) == 256 * MIB
    r = q.http.post(
        "/api/code/test",
        json={"code": MEMORY_LIMIT, "memory": "1g"},
        headers=q.as_user("cy"),
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "succeeded" and int(body["output"]) == GIB, body
    assert q.client.status(body["job_id"]).worker.startswith(big_worker.node + ":")

    # what the default group cannot hold, asked of it by name, is the caller's to fix
    r = q.http.post(
        "/api/runs",
        json={"code": TRIVIAL, "memory": "1g", "group": "default"},
        headers=q.as_user("ann"),
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "CODE_INVALID", r.text
    assert "group default (256m, 0.5 CPU per slot)" in r.json()["error"]["message"]
    print(json.dumps({"big": rec.worker, "small": sorted(r.worker for r in done.values())}))


@pytest.mark.redis
def test_a_group_whose_live_workers_hold_less_is_refused(
    redis_server: Any, tmp_path: Path, make_settings: Any
) -> None:
    """A live worker of the group whose slot holds less than the job asks (its announced
    caps) does not count: the submit is refused naming it and what its slot holds; a job
    it holds is queued in the group's own list. The worker's own heartbeat, real Redis."""
    from testkit.stack import client_for
    from worker.upkeep.heartbeat import Heartbeat

    beat = Heartbeat(
        redis_server.url,
        "half@test",
        {"code.test.big": 1, "code.run.big": 1},
        interval_s=0.2,
        ttl_s=1.6,
        group={"group": "big", "memory_bytes": 512 * MIB, "cpus": 1.0},
    )
    beat.start()
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    try:
        with client_for(make_settings, redis_server.url, url, worker_groups="big:1g:1") as c:
            with pytest.raises(RuntimeUnavailable) as refused:
                c.submit(TRIVIAL, "python", {}, memory="1g", user="ann")
            message = refused.value.message
            assert "No live worker of group 'big' holds this job" in message, message
            assert "half@test (512m of memory and 1 CPU per slot)" in message, message
            # 512m: more than the default group holds, what big's worker does
            job = c.submit(TRIVIAL, "python", {}, memory="512m", user="ann")
            assert c.store.get(job).worker_group == "big"
            assert (c.redis.llen("code.run.big"), c.redis.llen("code.run")) == (1, 0)
            test = c.submit(TRIVIAL, "python", {}, kind="test", group="big", user="ann")
            assert c.status(test).status == "queued" and c.redis.llen("code.test.big") == 1
            why = c.why_waiting(c.status(job))
            assert why is not None and why.queue == "code.run.big", why
    finally:
        beat.stop()


def _backlog(text: str) -> dict[str, float]:
    """studio_code_queue_backlog by queue, from a /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        sample.labels["queue"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "studio_code_queue_backlog"
        for sample in family.samples
    }


# --- the rule and the settings, no service ---------------------------------------------------

DEFAULT = Group(DEFAULT_GROUP, 256 * MIB, 0.5)
BIG = Group("big", 4 * GIB, 4)
WIDE = Group("wide", 1 * GIB, 8)
GROUPS = (DEFAULT, BIG, WIDE)


@pytest.mark.parametrize(
    ("memory", "cpus", "asked", "expected"),
    [
        (256 * MIB, 0.5, None, "default"),  # what the default group holds stays there
        (128 * MIB, 0.25, None, "default"),
        (512 * MIB, 0.5, None, "wide"),  # the smallest group (by memory) that holds it
        (2 * GIB, 0.5, None, "big"),
        (512 * MIB, 6, None, "wide"),  # more CPU than big holds
        (128 * MIB, 0.5, "big", "big"),  # the caller's choice, when it holds the job
        (128 * MIB, 0.5, "default", "default"),
    ],
)
def test_choose_by_size_or_by_name(
    memory: int, cpus: float, asked: str | None, expected: str
) -> None:
    assert choose(GROUPS, memory, cpus, asked).name == expected


def test_choose_refuses_what_no_group_holds() -> None:
    with pytest.raises(CodeInvalid) as e:
        choose(GROUPS, 8 * GIB, 1, None)
    assert "8g of memory and 1 CPU" in e.value.message
    assert "big (4g, 4 CPU per slot)" in e.value.message
    with pytest.raises(CodeInvalid, match="more than a slot of group default"):
        choose(GROUPS, 1 * GIB, 0.5, "default")
    with pytest.raises(CodeInvalid, match="group='huge' is not a worker group here"):
        choose(GROUPS, 1 * GIB, 0.5, "huge")
    with pytest.raises(CodeInvalid, match="more than a slot of any worker group"):
        choose((DEFAULT,), 512 * MIB, 0.5, None)


def test_worker_groups_setting(make_settings: Any) -> None:
    s = make_settings(worker_groups="big:4g:4, wide:1g:8", code_max_memory="512m")
    groups = groups_of(s)
    assert [g.name for g in groups] == ["default", "big", "wide"]
    assert groups[0] == Group("default", 512 * MIB, s.max_cpus)  # the process's own caps
    assert widest(groups) == (4 * GIB, 8.0)
    assert make_settings().worker_group == "default" and groups_of(make_settings())[1:] == ()
    assert make_settings(worker_group="big").worker_group == "big"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("big", "NAME:MEMORY:CPUS"),
        ("big:4g", "NAME:MEMORY:CPUS"),
        ("Big:4g:4", "not a group name"),
        ("default:4g:4", "the default group holds"),
        ("big:4g:4,big:8g:8", "given twice"),
        ("big:lots:4", "NAME:MEMORY:CPUS"),
        ("big:1m:4", "a slot must hold at least"),
        ("big:4g:0", "a slot must hold at least"),
        (",".join(f"g{i}:1g:1" for i in range(9)), "at most 8"),
    ],
)
def test_bad_worker_groups_are_refused(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_groups(text)


def test_settings_refuse_a_bad_group(make_settings: Any) -> None:
    from executor.errors import SettingsError

    with pytest.raises((SettingsError, ValueError), match="STUDIO_WORKER_GROUPS|worker_groups"):
        make_settings(worker_groups="big:4g")
    with pytest.raises((SettingsError, ValueError), match="STUDIO_WORKER_GROUP|worker_group"):
        make_settings(worker_group="Big Ones")


def test_queues_of_a_group() -> None:
    from worker.protocol import group_of_queue, group_queues, kind_of_queue, queue_of

    assert group_queues(None) == group_queues("default") == ("code.test", "code.run")
    assert group_queues("big") == ("code.test.big", "code.run.big")
    assert queue_of("run", "big") == "code.run.big" and queue_of("test") == "code.test"
    assert [kind_of_queue(q) for q in ("code.test.big", "code.run.big", "code.test")] == [
        "test",
        "run",
        "test",
    ]
    assert group_of_queue("code.run.big") == "big" and group_of_queue("code.run") == "default"


def test_a_group_job_never_taken_says_how_to_start_its_worker(make_settings: Any) -> None:
    from worker.protocol import never_taken_message

    s = make_settings(queue_run_max_wait_s=60)
    assert "`studio-code worker --group big`" in never_taken_message(s, "code.run.big")
    assert "`studio-code worker`" in never_taken_message(s, "code.run")


def test_an_announcement_says_its_group() -> None:
    from worker.registry import WorkerInfo

    raw = json.dumps(
        {"nodename": "w@h", "slots": 1, "group": "big", "memory_bytes": GIB, "cpus": 2}
    )
    info = WorkerInfo.parse(raw, "code.run.big")
    assert info is not None and (info.group, info.memory_bytes, info.cpus) == ("big", GIB, 2.0)
    assert info.holds(GIB, 2) and not info.holds(GIB + 1, 1) and not info.holds(GIB, 3)
    older = WorkerInfo.parse(json.dumps({"nodename": "w@h", "slots": 1}), "code.run")
    assert older is not None and older.group == "default" and older.holds(8 * GIB, 64)
