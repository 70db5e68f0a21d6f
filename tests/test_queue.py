"""The queue end to end: the real client, a real redis-server (the ``redis_server`` fixture),
real prefork worker PROCESSES (``celery -A worker worker``), real Docker, SQLite and
PostgreSQL. Never task_always_eager. Every worker started here is stopped by pid.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from testkit.processes import HOST, alive, children, wait_for
from testkit.sandboxes import containers_of, sandbox_events
from tests.conftest import run_cli
from tests.snippets import SPIN, TRIVIAL, sleeper

LABEL_JOB = "studio.job_id"
LABEL_OWNER = "studio.owner"


# --- processes ------------------------------------------------------------------------------


#: how long a test waits for a job's sandbox to be running: a hang guard, not a speed test
#: (on a loaded CI machine one such wait once ran past 30 s; speed is in make bench)
SANDBOX_UP_S = 60.0


# --- fixtures -------------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'store' / 'studio-code.db'}"
        return
    yield request.getfixturevalue("pg_schema_url")


# --- submit -> result --------------------------------------------------------------------------


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_submit_result_lands_in_the_store(make_stack: Any, database_url: str) -> None:
    q = make_stack(database_url=database_url)
    w = q.start_worker("w1", 1)
    ok = q.client.submit(
        "def main(state):\n    print('hi')\n    return state['n'] * 2\n", "python", {"n": 21}
    )
    bad = q.client.submit("def main(state):\n    raise ValueError('nope')\n", "python", "{}")
    test = q.client.submit(TRIVIAL, "python", {"n": 4}, kind="test", user="ann")
    rec = q.client.wait(ok, 60)
    assert rec.status == "succeeded", (rec, w.tail())
    assert rec.output == 42 and "hi" in rec.logs
    assert rec.attempts == 1 and rec.worker and rec.worker.startswith(w.node + ":")
    assert rec.runtime == "docker" and rec.code_runtime == "docker"
    assert rec.duration_ms and rec.duration_ms > 0
    assert rec.started_at and rec.finished_at and rec.queued_at <= rec.started_at
    failed = q.client.wait(bad, 60)
    assert failed.status == "failed" and failed.error and failed.error.code == "CODE_ERROR"
    assert "nope" in failed.error.message
    tested = q.client.wait(test, 60)
    assert tested.status == "succeeded" and tested.output == 8 and tested.kind == "test"
    for job_id in (ok, bad, test):
        assert q.done_count(job_id) == 1


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_the_done_notice_carries_the_finished_record(
    make_stack: Any, database_url: str, make_settings: Any, tmp_path: Path
) -> None:
    """A short finished record travels in the job's done notice, exactly as the store holds
    it, so ``wait`` answers without reading the store back; a long one (logs past
    NOTICE_RECORD_MAX) leaves "1" and ``wait`` reads the store. Shown with a second client
    on the same Redis and an EMPTY store of its own: it gets the short record from the
    notice alone, and for the long one it reads its own store and finds nothing."""
    from api_client import CodeClient, JobNotFound
    from executor.store import JobRecord
    from worker.protocol import NOTICE_RECORD_MAX, done_key

    q = make_stack(database_url=database_url)
    q.start_worker("w1", 1)
    short = q.client.submit(
        "def main(state):\n    print('hi')\n    return {'n': state['n']}\n", "python", {"n": 1}
    )
    long = q.client.submit(
        f"def main(state):\n    print('x' * {NOTICE_RECORD_MAX})\n    return 2\n", "python", {}
    )
    other = CodeClient(
        make_settings(
            redis_url=q.redis_url, database_url=f"sqlite:///{tmp_path / 'other' / 'empty.db'}"
        )
    )
    try:
        for job_id in (short, long):
            rec = q.client.wait(job_id, 60, submitted=True)
            assert rec.status == "succeeded", rec
            assert rec == q.client.status(job_id), "the record waited for is the stored one"
            assert q.done_count(job_id) == 1
        (item,) = q.client.redis.lrange(done_key(short), 0, -1)
        carried = JobRecord.model_validate_json(item)
        assert carried == q.client.status(short) and carried.output == {"n": 1}
        assert carried.logs == "hi\n" and carried.worker and carried.finished_at
        assert other.wait(short, 5, submitted=True) == carried  # from the notice alone
        assert q.client.redis.lrange(done_key(long), 0, -1) == [b"1"]
        with pytest.raises(JobNotFound):  # "1": it reads the (other, empty) store
            other.wait(long, 5, submitted=True)
    finally:
        other.close()


# --- test calls never wait behind runs ---------------------------------------------------


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_test_call_never_waits_behind_runs(make_stack: Any, docker_client: Any) -> None:
    """3 long runs fill the 3 run slots and a 4th waits; a test call submitted after all of
    them runs at once on the slot kept for code.test (one of STUDIO_CODE_CONCURRENCY=4,
    never on top of it); the 4th run is then cancelled while queued and never gets a
    container."""
    q = make_stack(code_concurrency=4)
    w = q.start_worker("w1", 4)
    assert len(children(w.pid)) == 4, "3 run slots + 1 test slot = STUDIO_CODE_CONCURRENCY"
    runs = [q.client.submit(sleeper(6), "python", {}) for _ in range(4)]
    since = int(time.time()) - 1
    wait_for(
        lambda: sum(bool(containers_of(docker_client, j, running=True)) for j in runs) == 3,
        30,
        "3 runs running",
    )
    t0 = time.monotonic()
    test = q.client.submit(TRIVIAL, "python", {"n": 5}, kind="test", user="ann")
    rec = q.client.wait(test, 30)
    took = time.monotonic() - t0
    print(f"\ntest call behind 3 long runs: {took * 1000:.0f} ms submit->result")
    assert rec.status == "succeeded" and rec.output == 10, (rec, w.tail())
    states = {j: q.client.status(j) for j in runs}
    assert sum(s.status == "running" for s in states.values()) == 3
    assert all(not s.finished for s in states.values()), "the test did not wait for a run"
    fourth = next(j for j, s in states.items() if s.status == "queued")

    assert q.client.cancel(fourth) == "cancelled"
    recs = q.wait_all([j for j in runs if j != fourth], 60)
    assert all(r.status == "succeeded" for r in recs.values())
    sentinel = q.client.submit(TRIVIAL, "python", {"n": 1})  # FIFO: after the 4th message
    assert q.client.wait(sentinel, 30).status == "succeeded"
    events = sandbox_events(docker_client, fourth, since, int(time.time()) + 1)
    assert events == [], "a job cancelled while queued must never get a container"
    cancelled = q.client.status(fourth)
    assert cancelled.status == "cancelled" and cancelled.started_at is None
    assert cancelled.error and cancelled.error.code == "CODE_CANCELLED"


# --- many jobs, two workers ------------------------------------------------------------------


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_200_jobs_over_two_workers_each_once(make_stack: Any, docker_client: Any) -> None:
    # every pre-started sandbox takes its job's name, however short the job: how the
    # sampler below sees the sandboxes of unfinished jobs
    q = make_stack(code_concurrency=2, code_prewarm_rename_after_s=0)
    workers = [q.start_worker("w1", 2), q.start_worker("w2", 2)]
    pid_to_worker: dict[int, str] = {}

    def refresh() -> None:
        for w in workers:
            for pid in w.tree():
                pid_to_worker[pid] = w.name

    refresh()
    peak: dict[str, int] = defaultdict(int)
    samples = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal samples
        while not stop.is_set():
            per: Counter[str] = Counter()
            # Sandboxes of jobs not finished yet: a pre-started one that answered is removed
            # just after (off the job's path), and idle pre-started ones run no job.
            boxes = {}
            for c in docker_client.api.containers(all=True, filters={"label": LABEL_OWNER}):
                name = c["Names"][0].lstrip("/")
                if name.startswith("studio-code-") and not name.startswith("studio-code-pool-"):
                    boxes[name.removeprefix("studio-code-")] = c
            ended = {j for j, r in q.client.store.get_many(list(boxes)).items() if r.finished}
            for job_id, c in boxes.items():
                if job_id in ended:
                    continue
                owner = (c.get("Labels") or {}).get(LABEL_OWNER, "")
                host, _, pid = owner.rpartition(":")
                if host != HOST or not pid.isdigit():
                    continue
                if int(pid) not in pid_to_worker:
                    refresh()
                if int(pid) in pid_to_worker:
                    per[pid_to_worker[int(pid)]] += 1
            for name, n in per.items():
                peak[name] = max(peak[name], n)
            samples += 1
            stop.wait(0.03)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.monotonic()
    try:
        jobs = {q.client.submit(TRIVIAL, "python", {"n": i}): i for i in range(200)}
        recs = q.wait_all(list(jobs), 200)
    finally:
        stop.set()
        sampler.join(5)
    took = time.monotonic() - t0
    by_worker = Counter((r.worker or "").split("@")[0] for r in recs.values())
    print(
        f"\n200 jobs in {took:.1f} s ({200 / took:.1f}/s); by worker {dict(by_worker)}; "
        f"peak containers per worker {dict(peak)} over {samples} samples"
    )
    assert all(r.status == "succeeded" for r in recs.values()), Counter(
        r.status for r in recs.values()
    )
    assert all(recs[j].output == 2 * i for j, i in jobs.items())
    assert all(r.attempts == 1 for r in recs.values())
    assert all(q.done_count(j) == 1 for j in jobs), "each job's task body ended exactly once"
    assert set(by_worker) == {"w1", "w2"}
    assert samples > 20
    assert max(peak.values()) <= 2, f"more than STUDIO_CODE_CONCURRENCY=2 at once: {peak}"


# --- cancel ------------------------------------------------------------------------------------


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_cancel_running_job_from_another_process(make_stack: Any, docker_client: Any) -> None:
    q = make_stack(code_concurrency=1)
    w = q.start_worker("w1", 1)
    job = q.client.submit(SPIN, "python", {})
    box = wait_for(
        lambda: containers_of(docker_client, job, running=True), SANDBOX_UP_S, "the sandbox"
    )
    owner_pid = int(box[0].labels[LABEL_OWNER].rpartition(":")[2])
    t0 = time.monotonic()
    proc = run_cli("cancel", job, env=q.env(), timeout=60)
    t_cli = time.monotonic()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout) == {"job_id": job, "status": "cancelling", "error": None}
    wait_for(lambda: not containers_of(docker_client, job), 10, "the sandbox gone", 0.005)
    gone = time.monotonic()
    print(
        f"\ncancel from another process: container gone {(gone - t0) * 1000:.0f} ms after "
        f"the CLI started, {(gone - t_cli) * 1000:.0f} ms after it exited"
    )
    rec = q.client.wait(job, 30)
    assert rec.status == "cancelled", (rec, w.tail())
    assert rec.error and rec.error.code == "CODE_CANCELLED"
    assert rec.output is None
    # The cancel signal did not end the pool process: it runs the next job.
    assert alive(owner_pid)
    nxt = q.client.submit(TRIVIAL, "python", {"n": 3})
    assert q.client.wait(nxt, 30).output == 6


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_cancel_without_revoke_still_stops_the_job(make_stack: Any, docker_client: Any) -> None:
    """The revoke broadcast is not stored: a worker that misses it must still stop the job.
    No revoke is sent here at all: (a) store intent + Redis flag, (b) store intent alone."""
    from worker.protocol import cancel_key

    q = make_stack(code_concurrency=1)
    w = q.start_worker("w1", 1)
    for how in ("flag", "store only"):
        job = q.client.submit(SPIN, "python", {})
        wait_for(
            lambda j=job: containers_of(docker_client, j, running=True), SANDBOX_UP_S, "the sandbox"
        )
        t0 = time.monotonic()
        assert q.client.store.request_cancel(job) == "cancelling"
        if how == "flag":
            q.client.redis.set(cancel_key(job), "1", ex=60)
        wait_for(lambda j=job: not containers_of(docker_client, j), 10, "the sandbox gone", 0.005)
        print(f"\nno revoke, {how}: sandbox gone in {(time.monotonic() - t0) * 1000:.0f} ms")
        rec = q.client.wait(job, 30)
        assert rec.status == "cancelled", (rec, w.tail())


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_stray_cancel_signal_does_not_kill_the_next_job(
    make_stack: Any, docker_client: Any
) -> None:
    """The terminate race: Celery signals the PID that took a job, which may be running
    another job by then. That signal must not stop the other job."""
    from worker.protocol import CANCEL_SIGNAL

    q = make_stack(code_concurrency=1)
    q.start_worker("w1", 1)
    job = q.client.submit(sleeper(2, "survived"), "python", {})
    box = wait_for(
        lambda: containers_of(docker_client, job, running=True), SANDBOX_UP_S, "the sandbox"
    )
    pid = int(box[0].labels[LABEL_OWNER].rpartition(":")[2])
    os.kill(pid, CANCEL_SIGNAL)  # as a terminate meant for this process's previous job
    rec = q.client.wait(job, 30)
    assert rec.status == "succeeded" and rec.output == "survived"
    assert alive(pid)


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_backstop_kills_when_the_pool_process_cannot(make_stack: Any, docker_client: Any) -> None:
    """The pool process running the job is frozen (SIGSTOP): the worker's main process
    (task_revoked) removes the sandbox by label and ends the job cancelled."""
    q = make_stack(code_concurrency=1)
    w = q.start_worker("w1", 1)
    job = q.client.submit(SPIN, "python", {})
    box = wait_for(
        lambda: containers_of(docker_client, job, running=True), SANDBOX_UP_S, "the sandbox"
    )
    pid = int(box[0].labels[LABEL_OWNER].rpartition(":")[2])
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert q.client.cancel(job) == "cancelling"
        wait_for(lambda: not containers_of(docker_client, job), 15, "the backstop's kill", 0.02)
        gone = time.monotonic() - t0
        rec = q.client.wait(job, 30)
        print(
            f"\nbackstop: sandbox gone {gone:.1f} s, job {rec.status} "
            f"{time.monotonic() - t0:.1f} s after the cancel"
        )
        assert rec.status == "cancelled", (rec, w.tail())
        assert "backstop" in w.tail(200)
    finally:
        os.kill(pid, signal.SIGCONT)
    nxt = q.client.submit(TRIVIAL, "python", {"n": 4})  # the thawed process goes on
    assert q.client.wait(nxt, 30).output == 8
    assert q.client.status(job).status == "cancelled"


# --- crashes -----------------------------------------------------------------------------------


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.timeout(150)
def test_worker_sigkill_mid_job(make_stack: Any, docker_client: Any) -> None:
    """SIGKILL a worker (main process and children) while its job runs: the next worker
    reaps the orphaned sandbox and the job ends exactly once."""
    q = make_stack(code_concurrency=1, code_max_seconds=5, queue_visibility_timeout_s=6)
    w1 = q.start_worker("w1", 1)
    job = q.client.submit(sleeper(3, "ok"), "python", {})
    box = wait_for(
        lambda: containers_of(docker_client, job, running=True), SANDBOX_UP_S, "the sandbox"
    )
    orphan = box[0].id
    killed = w1.kill_hard()
    wait_for(lambda: not any(alive(p) for p in killed), 10, "the killed processes to end")
    assert containers_of(docker_client, job), "the sandbox outlives its worker"
    t0 = time.monotonic()
    w2 = q.start_worker("w2", 1)
    wait_for(
        lambda: not docker_client.api.containers(all=True, filters={"id": orphan}),
        20,
        "the reaper to remove the orphan",
        0.05,
    )
    print(f"\norphan sandbox gone {time.monotonic() - t0:.1f} s after the new worker was launched")
    rec = q.client.wait(job, 60)
    print(
        f"job after the crash: {rec.status}, attempts {rec.attempts}, "
        f"error {rec.error and rec.error.message}"
    )
    assert rec.finished, w2.tail()
    if rec.status == "succeeded":
        assert rec.output == "ok" and rec.attempts == 2
        assert rec.worker and rec.worker.startswith(w2.node)
    else:
        assert rec.status == "failed" and rec.error and "worker" in rec.error.message
    time.sleep(1)
    assert q.done_count(job) == 1, "the job's task body ended exactly once"
    assert not containers_of(docker_client, job)


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_redis_restart_loses_no_queued_job(make_stack: Any, redis_server: Any) -> None:
    # Jobs queued before any worker starts: the fail-fast check is off on purpose.
    q = make_stack(code_concurrency=2, queue_require_worker=False)
    jobs = {q.client.submit(TRIVIAL, "python", {"n": i}): i for i in range(6)}
    # A crash, not a clean stop (SIGTERM would flush the AOF anyway), after the one second
    # that appendfsync everysec may lose.
    time.sleep(1.5)
    redis_server.stop(kill=True)
    redis_server.start()  # same port, same AOF
    q.start_worker("w1", 2)
    recs = q.wait_all(list(jobs), 60)
    assert {j: r.output for j, r in recs.items()} == {j: 2 * i for j, i in jobs.items()}


# --- editor test calls: rate limit, inline runs ---------------------------------------------


@pytest.mark.redis
def test_rate_limit_counts_across_clients(
    redis_server: Any, sqlite_url: str, make_settings: Any
) -> None:
    from api_client import CodeClient, RateLimited

    settings = make_settings(
        redis_url=redis_server.url,
        database_url=sqlite_url,
        code_test_per_minute=20,
        queue_require_worker=False,
    )
    with CodeClient(settings) as a, CodeClient(settings) as b:
        for i in range(20):
            (a if i % 2 else b).submit(TRIVIAL, "python", {}, kind="test", user="ann")
        with pytest.raises(RateLimited) as caught:
            a.submit(TRIVIAL, "python", {}, kind="test", user="ann")
        assert 0 < caught.value.retry_after_s <= 60
        assert caught.value.code == "RATE_LIMITED"
        assert "try again in" in caught.value.message
        with pytest.raises(RateLimited):
            b.submit(TRIVIAL, "python", {}, kind="test", user="ann")
        b.submit(TRIVIAL, "python", {}, kind="test", user="bob")  # another user
        a.submit(TRIVIAL, "python", {}, kind="run", user="ann")  # workflow runs: no limit


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_run_inline_caps_sandboxes_per_process(
    redis_server: Any, sqlite_url: str, make_settings: Any, python_image: str, docker_client: Any
) -> None:
    from api_client import CodeClient

    settings = make_settings(
        redis_url=redis_server.url,
        database_url=sqlite_url,
        code_concurrency=2,
        code_image=python_image,
    )
    me = f"{HOST}:{os.getpid()}"
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            n = len(
                docker_client.api.containers(
                    all=True, filters={"label": [LABEL_JOB, f"{LABEL_OWNER}={me}"]}
                )
            )
            peak = max(peak, n)
            stop.wait(0.03)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with CodeClient(settings) as client, ThreadPoolExecutor(5) as pool:
        try:
            results = list(
                pool.map(
                    lambda i: client.run_inline(sleeper(1, f"r{i}"), "python", {}, user="ann"),
                    range(5),
                )
            )
        finally:
            stop.set()
            sampler.join(5)
        assert [r.status for r in results] == ["succeeded"] * 5, [r.error for r in results]
        assert [r.output for r in results] == [f"r{i}" for i in range(5)]
        assert client.status(results[0].job_id).status == "succeeded"
    print(f"\ninline: peak sandboxes of this process {peak}")
    assert 1 <= peak <= 2


def test_submit_refuses_bad_input_before_queueing(make_settings: Any, tmp_path: Path) -> None:
    from api_client import CodeClient, CodeInvalid, CodeNodesDisabled, RuntimeUnavailable

    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    # An unreachable Redis: none of these may get as far as the queue.
    settings = make_settings(redis_url="redis://127.0.0.1:1/0", database_url=url)
    with CodeClient(settings) as client:
        with pytest.raises(CodeInvalid, match="main"):
            client.submit("x = 1\n", "python", {})
        with pytest.raises(CodeInvalid):
            client.submit("def main(state:\n", "python", {})
        with pytest.raises(CodeInvalid, match="not valid JSON"):
            client.submit(TRIVIAL, "python", "{nope")
        with pytest.raises(CodeInvalid, match="JSON"):
            client.submit(TRIVIAL, "python", {"s": {1, 2}})
        with pytest.raises(CodeInvalid, match="kind"):
            client.submit(TRIVIAL, "python", {}, kind="bulk")  # type: ignore[arg-type]
        with pytest.raises(CodeInvalid, match="timeout"):
            client.submit(TRIVIAL, "python", {}, timeout_s=0)
        assert client.validate("def main(state):\n    return 1\n", "python") == []
        assert client.validate("x = 1\n", "python")
        assert client.store.counts_by_status()["queued"] == 0
    # Valid, but Redis is down: refused before the row (no worker can be seen), and with
    # that check off the job ends failed (never stuck queued); the caller hears either way.
    with CodeClient(settings) as client:
        with pytest.raises(RuntimeUnavailable, match="Redis"):
            client.submit(TRIVIAL, "python", {})
        assert sum(client.store.counts_by_status().values()) == 0
    unchecked = make_settings(
        redis_url="redis://127.0.0.1:1/0", database_url=url, queue_require_worker=False
    )
    with CodeClient(unchecked) as client:
        with pytest.raises(RuntimeUnavailable, match="Redis"):
            client.submit(TRIVIAL, "python", {})
        counts = client.store.counts_by_status()
        assert counts["failed"] == 1 and counts["queued"] == 0
    off = make_settings(
        enable_code_nodes=False, redis_url="redis://127.0.0.1:1/0", database_url=url
    )
    with CodeClient(off) as client, pytest.raises(CodeNodesDisabled):
        client.submit(TRIVIAL, "python", {})


# --- the CLI -----------------------------------------------------------------------------------


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_cli_worker_submit_status_cancel(make_stack: Any, tmp_path: Path) -> None:
    q = make_stack(code_concurrency=1)
    w = q.start_worker("cli1", 1, cli=True, capture_stdout=True)
    src = tmp_path / "node.py"
    src.write_text(TRIVIAL)
    env = q.env()
    sub = run_cli("submit", str(src), "--wait", "--state", '{"n": 20}', env=env)
    assert sub.returncode == 0, sub.stdout + sub.stderr + w.tail()
    out = json.loads(sub.stdout)
    assert out["status"] == "succeeded" and out["output"] == 40 and out["runtime"] == "docker"
    st = run_cli("status", out["job_id"], env=env)
    assert st.returncode == 0 and json.loads(st.stdout)["output"] == 40
    late = run_cli("cancel", out["job_id"], env=env)
    assert late.returncode == 1 and json.loads(late.stdout)["status"] == "succeeded"
    queued = run_cli("submit", str(src), "--kind", "test", "--user", "ann", env=env)
    assert queued.returncode == 0 and json.loads(queued.stdout)["queue"] == "code.test"
    missing = run_cli("status", "no-such-job", env=env)
    assert missing.returncode == 1 and json.loads(missing.stdout)["status"] is None
    bad = run_cli("submit", str(src), "--state", "{nope", env=env)
    assert bad.returncode == 1 and json.loads(bad.stdout)["status"] == "invalid"
    w.stop()
    assert w.proc.stdout is not None
    lines = w.proc.stdout.read().decode().strip().splitlines()
    assert len(lines) == 1, lines
    assert json.loads(lines[0]) == {"command": "worker", "status": "stopped", "exit_code": 0}
