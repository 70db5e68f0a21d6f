"""A worker's upkeep under load and under a restarting engine (executor/runtimes/docker/pool.py):
a steady backlog never starves the removal of used sandboxes (their number, the worker's
fds and RSS stay bounded), and restarts of an engine of the test's own leave no container
after a warm stop. Real Celery workers, real Docker, loopback only."""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any

import pytest

from executor.errors import RuntimeUnavailable
from testkit.engine import SecondEngine
from testkit.processes import children, require, wait_for
from testkit.sandboxes import LABEL_OWNER, watch_backlog
from testkit.stack import Stack
from tests.snippets import TRIVIAL, WHOAMI, sleeper

pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.redis]


@pytest.mark.timeout(1100)
def test_a_backlog_never_starves_the_removal_of_used_sandboxes(
    make_stack: Any,  # noqa: F811 - the fixture imported above
    docker_client: Any,
) -> None:
    """300 jobs queued at once on one worker (concurrency 2, one pre-started sandbox per
    slot): at every sample the worker's ended-but-not-removed sandboxes are at most
    2 x concurrency, and its process tree's fds and RSS do not grow from job 100 to job 300.
    Every job succeeds exactly once. (300, not 500: the whole CI must stay under 30 minutes
    on a slow 2-core machine; weeks of jobs are the soak's, ``make soak``.)"""
    n, concurrency = 300, 2
    q: Stack = make_stack(code_concurrency=concurrency, code_languages="python", queue_test_slots=0)
    w = q.start_worker("backlog", concurrency)
    owners = {f"{os.uname().nodename}:{pid}" for pid in children(w.pid)}
    assert len(owners) == concurrency
    jobs = {q.client.submit(TRIVIAL, "python", {"n": i}): i for i in range(n)}
    ids = list(jobs)
    # a hang guard, not a speed test: a loaded 2-core machine has run them at ~1 job/s
    seen = watch_backlog(
        docker_client.api, q.client.store, ids, w, owners, marks=(100, n), timeout_s=900
    )
    print(f"\n{n} jobs: {seen.summary()}")
    recs = seen.records
    assert Counter(r.status for r in recs.values()) == {"succeeded": n}
    assert all(recs[j].output == 2 * i for j, i in jobs.items())
    assert all(r.attempts == 1 for r in recs.values())
    assert all(q.done_count(j) == 1 for j in ids), "each job's task body ended exactly once"
    assert seen.samples > 20
    assert seen.ended_max <= 2 * concurrency, (
        f"{seen.ended_max} ended sandboxes awaiting removal: {seen.worst}"
    )
    (fds0, rss0, threads0), (fds1, rss1, threads1) = seen.usage[100], seen.usage[n]
    assert fds1 - fds0 < 30, f"fds grew {fds0} -> {fds1} with jobs"
    assert rss1 - rss0 < 30 * 2**20, f"RSS grew {rss0} -> {rss1} bytes with jobs"
    assert threads1 - threads0 < 10, f"threads grew {threads0} -> {threads1}"


# --- an engine that restarts ----------------------------------------------------------------


def engine_sandboxes(engine: SecondEngine) -> list[dict]:
    """Every container with the project's labels on ``engine`` (a job's or a pool's)."""
    out = engine.docker(
        "ps", "-a", "--filter", f"label={LABEL_OWNER}", "--format", "{{.ID}} {{.Names}} {{.Status}}"
    ).stdout
    keys = ("id", "name", "status")
    return [dict(zip(keys, line.split(" ", 2), strict=True)) for line in out.splitlines()]


def engine_ids(engine: SecondEngine) -> set[str]:
    return set(engine.docker("ps", "-aq", "--no-trunc").stdout.split())


@pytest.mark.timeout(480)
def test_engine_restarts_under_a_worker_leave_no_container_after_a_warm_stop(
    make_stack: Any,  # noqa: F811 - the fixture imported above
    python_image: str,
) -> None:
    """An engine of the test's own (its dockerd and containerd; never the machine's) is
    restarted twice under a worker with pre-started sandboxes, two jobs running each time:
    they end clearly, the jobs after each restart all succeed, none of them in a
    sandbox that was there before the restart (the dead idle ones are replaced, never handed
    out), and a warm stop of the worker leaves no container on the engine."""
    require(os.geteuid() == 0, "a second dockerd needs root")
    engine = SecondEngine()
    try:
        engine.start()
        engine.load(python_image)
        q: Stack = make_stack(code_concurrency=2, code_languages="python", queue_test_slots=0)
        w = q.start_worker(
            "restarts", 2, env={"DOCKER_HOST": engine.host}, stop_timeout=60, ready_timeout_s=90
        )
        wait_for(
            lambda: len([c for c in engine_sandboxes(engine) if "Up" in c["status"]]) == 2,
            60,
            "both slots' pre-started sandboxes",
            interval_s=0.2,
        )

        def submit(code: str, state: Any) -> str:
            """Submit, retrying while the worker says it cannot serve (its engine is back,
            its gate not yet reopened)."""
            deadline = time.monotonic() + 90
            while True:
                try:
                    return q.client.submit(code, "python", state, timeout_s=30)
                except RuntimeUnavailable:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)

        def batch(n: int, before: set[str]) -> None:
            jobs = [submit(WHOAMI, {}) for _ in range(n)]
            recs = q.wait_all(jobs, 120)
            assert [r.status for r in recs.values()] == ["succeeded"] * n, [
                (r.status, r.error) for r in recs.values()
            ]
            used = {r.output["cid"] for r in recs.values()}
            assert len(used) == n and not any(r.output["reused"] for r in recs.values())
            assert not used & before, "a sandbox from before the restart ran a job"

        batch(4, set())
        endings = []
        for restart in (1, 2):
            # One job outlives dockerd's 10 s stop grace for its containers (killed: handed
            # back, run again); one answers within it, after the engine's API is gone (its
            # sandbox's removal fails then, and must be done later).
            long, short = submit(sleeper(20), {}), submit(sleeper(3), {})
            wait_for(
                lambda jobs=(long, short): all(
                    any(
                        c["name"] == f"studio-code-{j}" and "Up" in c["status"]
                        for c in engine_sandboxes(engine)
                    )
                    for j in jobs
                ),
                60,
                "both jobs running",
                interval_s=0.2,
            )
            before = engine_ids(engine)
            t0 = time.monotonic()
            engine.stop()
            engine.start()
            print(f"\nrestart {restart}: the engine was away {time.monotonic() - t0:.1f} s")
            for job in (long, short):
                rec = q.client.wait(job, 120)
                assert rec.finished, f"restart {restart}: a running job did not end: {rec}"
                endings.append((rec.status.value, rec.error.code if rec.error else None))
                # Ended clearly: it succeeded (before the engine went, or run again after
                # it came back) or failed saying why; never stuck, never ended twice.
                if rec.status != "succeeded":
                    assert rec.status == "failed" and rec.error is not None, rec
                    assert rec.error.code and rec.error.message, rec
                assert q.done_count(job) == 1
            batch(6, before)
        print(f"\nthe jobs running during each restart ended: {endings}")
        assert w.alive(), w.tail(60)
        assert w.stop() == 0, w.tail(60)
        left = engine_sandboxes(engine)
        assert left == [], f"the warm stop left containers on the engine: {left}"
    finally:
        engine.stop()
        engine.remove()
