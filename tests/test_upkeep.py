"""A worker's upkeep under load and under a restarting engine (executor/runtimes/pool.py):
a steady backlog never starves the removal of used sandboxes (their number, the worker's
fds and RSS stay bounded), and restarts of an engine of the test's own leave no container
after a warm stop. Real Celery workers, real Docker, loopback only."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.services import process_tree
from tests.test_queue import (  # noqa: F401 - queue_env, sqlite_url: fixtures used by name
    TRIVIAL,
    QueueEnv,
    children,
    queue_env,
    sqlite_url,
)

LABEL_OWNER = "studio.owner"
#: a container that ran and ended: what awaits its removal (a pre-started one waiting for
#: its job is running; one being created for a cold job is "created", not yet used)
ENDED = ("exited", "dead")


def ended_sandboxes(api: Any, owners: set[str]) -> list[dict]:
    """The sandboxes of ``owners`` (host:pid of a worker's pool processes) that ended and
    are not removed yet."""
    out = []
    for status in ENDED:
        for c in api.containers(all=True, filters={"label": LABEL_OWNER, "status": status}):
            if (c.get("Labels") or {}).get(LABEL_OWNER) in owners:
                out.append(c)
    return out


def tree_usage(pid: int) -> tuple[int, int, int]:
    """Open fds, RSS (bytes) and threads of ``pid``'s process tree, from /proc."""
    fds = rss = threads = 0
    for p in process_tree(pid):
        try:
            fds += len(os.listdir(f"/proc/{p}/fd"))
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("Threads:"):
                    threads += int(line.split()[1])
        except OSError:
            pass
    return fds, rss, threads


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.timeout(600)
def test_a_backlog_never_starves_the_removal_of_used_sandboxes(
    queue_env: Any,  # noqa: F811 - the fixture imported above
    docker_client: Any,
) -> None:
    """500 jobs queued at once on one worker (concurrency 2, one pre-started sandbox per
    slot): at every sample the worker's ended-but-not-removed sandboxes are at most
    2 x concurrency, and its process tree's fds and RSS do not grow from job 100 to job 500.
    Every job succeeds exactly once."""
    n, concurrency = 500, 2
    q: QueueEnv = queue_env(
        code_concurrency=concurrency, code_languages="python", queue_test_slots=0
    )
    w = q.start_worker("backlog", concurrency)
    owners = {f"{os.uname().nodename}:{pid}" for pid in children(w.pid)}
    assert len(owners) == concurrency
    jobs = {q.client.submit(TRIVIAL, "python", {"n": i}): i for i in range(n)}
    ids = list(jobs)
    ended_max, samples = 0, 0
    worst: list[str] = []
    usage: dict[int, tuple[int, int, int]] = {}  # finished jobs -> (fds, rss) first seen there
    deadline = time.monotonic() + 480
    while True:
        ended = ended_sandboxes(docker_client.api, owners)
        samples += 1
        if len(ended) > ended_max:
            ended_max = len(ended)
            worst = [f"{c['Names'][0]} {c['Status']}" for c in ended[:8]]
        recs = q.client.store.get_many(ids)
        done = sum(1 for r in recs.values() if r.finished)
        for mark in (100, n):
            if done >= mark and mark not in usage:
                usage[mark] = tree_usage(w.pid)
        if done == n:
            break
        assert time.monotonic() < deadline, f"{n - done} jobs not finished\n{w.tail(40)}"
        time.sleep(0.5)
    (fds100, rss100, threads100), (fds_end, rss_end, threads_end) = usage[100], usage[n]
    print(
        f"\n{n} jobs: ended-awaiting-removal max {ended_max} over {samples} samples; "
        f"job 100 -> job {n}: fds {fds100} -> {fds_end}, RSS {rss100 / 2**20:.1f} -> "
        f"{rss_end / 2**20:.1f} MiB, threads {threads100} -> {threads_end}"
    )
    assert Counter(r.status for r in recs.values()) == {"succeeded": n}
    assert all(recs[j].output == 2 * i for j, i in jobs.items())
    assert all(r.attempts == 1 for r in recs.values())
    assert all(q.done_count(j) == 1 for j in ids), "each job's task body ended exactly once"
    assert samples > 20
    assert ended_max <= 2 * concurrency, f"{ended_max} ended sandboxes awaiting removal: {worst}"
    assert fds_end - fds100 < 30, f"fds grew {fds100} -> {fds_end} with jobs"
    assert rss_end - rss100 < 30 * 2**20, f"RSS grew {rss100} -> {rss_end} bytes with jobs"
    assert threads_end - threads100 < 10, f"threads grew {threads100} -> {threads_end}"
