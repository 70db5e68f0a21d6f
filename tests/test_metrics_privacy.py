"""No user id in /metrics (issue 30, item 7): runs of 13 users wait behind a busy slot, with
fairness between users on, and the API's and the worker's /metrics, scraped over HTTP from
real processes, name none of them. The fair-share series are by rank only and bounded; the
names are in the admin's view of GET /api/meta/runtime only."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from testkit.processes import free_port, wait_for
from tests.snippets import ADMIN, SLEEP_CODE, TRIVIAL, USER

NAMES = (
    "alice bob carol dave erin frank grace heidi ivan judy mallory niaj olivia".split()  # 13
)
#: runs each user submits: at least 2, so each still has one waiting once a few are released
RUNS = (5, 4, 3) + (2,) * (len(NAMES) - 3)
TOP = 5  # worker.fair.TOP_USERS: the ranks /metrics shows


def samples(text: str) -> list[Any]:
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


@pytest.mark.docker  # make_stack's image
@pytest.mark.redis
@pytest.mark.timeout(240)
def test_metrics_name_no_user_while_13_users_wait(make_stack: Any, tmp_path: Any) -> None:
    q = make_stack(
        code_runtime="subprocess",
        code_concurrency=1,
        queue_test_slots=0,
        queue_run_fairness="users",
        code_max_seconds=120,
    )
    port = free_port()
    q.start_worker(
        "w1", 1, metrics_port=port, env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom")}
    )
    users = [f"{n}-{uuid.uuid4().hex[:12]}" for n in NAMES]
    holder = f"holder-{uuid.uuid4().hex[:12]}"
    # the one slot, busy: everything submitted after it waits
    held = q.client.submit(SLEEP_CODE, "python", {"s": 100}, user=holder, timeout_s=110)
    wait_for(lambda: q.client.status(held).status.value == "running", 60, "the holder to run")
    runs = [
        q.client.submit(TRIVIAL, "python", {}, user=u)
        for u, n in zip(users, RUNS, strict=True)
        for _ in range(n)
    ]
    fair = wait_for(
        lambda: (f := q.client.fairness())["users_waiting"] == len(NAMES) and f,
        30,
        "runs of all 13 users waiting on their lists",
        describe=q.client.fairness,
    )
    assert fair["waiting"] >= sum(RUNS) - 3, fair  # code.run holds the 2 released (1 slot)

    with q.start_api() as api:
        api_text = httpx.get(f"{api.base}/metrics", timeout=30).text
        worker_text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        public = httpx.get(f"{api.base}/api/meta/runtime", timeout=60)
        as_user = httpx.get(f"{api.base}/api/meta/runtime", headers={USER: users[0]}, timeout=60)
        as_admin = httpx.get(
            f"{api.base}/api/meta/runtime", headers={USER: "root", ADMIN: "1"}, timeout=60
        )

    # nowhere in either /metrics: no label value, no help text, nothing
    for who in (*users, holder):
        assert who not in api_text, f"the API's /metrics names {who}"
        assert who not in worker_text, f"the worker's /metrics names {who}"
    everything = samples(api_text) + samples(worker_text)
    assert not [s for s in everything if "user" in s.labels], "a label named user"

    # by rank only, bounded: ranks 1..5 and rest, one series each, while 13 users wait
    by_rank = [s for s in samples(api_text) if s.name == "studio_code_queue_user_waiting"]
    ranked = {s.labels["rank"]: s.value for s in by_rank}
    assert [tuple(s.labels) for s in by_rank] == [("rank",)] * (TOP + 1)
    assert set(ranked) == {*(str(r) for r in range(1, TOP + 1)), "rest"}
    users_waiting = [
        s.value for s in samples(api_text) if s.name == "studio_code_queue_users_waiting"
    ]
    assert users_waiting == [float(len(NAMES))]

    # the counts are the fair share's own, rank for rank (the admin's meta names them)
    assert as_admin.status_code == 200, as_admin.text
    top = as_admin.json()["fairness"]["top"]
    assert [t["rank"] for t in top] == list(range(1, TOP + 1))
    assert {t["user"] for t in top} <= set(users) and len({t["user"] for t in top}) == TOP
    assert [ranked[str(t["rank"])] for t in top] == [float(t["waiting"]) for t in top]
    waiting = as_admin.json()["fairness"]["waiting"]
    assert ranked["rest"] == waiting - sum(t["waiting"] for t in top) > 0
    assert ranked["1"] >= ranked["5"] >= 1

    # anyone else's meta: the same ranks and counts, no user id
    for answer in (public, as_user):
        assert answer.status_code == 200, answer.text
        for who in (*users, holder):
            assert who not in answer.text
        shown = answer.json()["fairness"]["top"]
        assert shown == [{k: v for k, v in t.items() if k != "user"} for t in top]

    for job in (held, *runs):
        q.client.cancel(job)
