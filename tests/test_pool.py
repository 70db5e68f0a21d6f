"""Pre-started sandboxes (executor/runtimes/docker/pool.py), against the real Docker engine and a
real worker: each pre-started container gets exactly ONE job, a job with other limits starts
cold, idle ones are replaced (age, a new image id), and nothing is left behind or reused after
a cancel, a timeout, OOM, a worker SIGKILL or a worker stop. Which container ran a job is
read from INSIDE it (its /etc/hostname mount names the container id)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from executor.models import CodeJob, Status
from testkit.processes import ROOT, children, wait_for
from testkit.sandboxes import LABEL_POOL, pool_containers
from testkit.sockguard import REAL_DOCKER_HOST, SockGuardProcess
from testkit.stack import Stack
from tests.conftest import THROUGH_SOCKGUARD
from tests.snippets import WHOAMI

pytestmark = pytest.mark.docker


def cid_in_logs(logs: str) -> str:
    line = next(x for x in logs.splitlines() if x.startswith("cid "))
    return line.split()[1]


def start_detail(trace: list[Any]) -> str:
    return next(r.detail for r in trace if r.step == "sandbox.start")


# --- one job per container ------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_each_pre_started_container_gets_exactly_one_job(pooled: Any, docker_client: Any) -> None:
    """50 jobs through a pool: every job's container id (seen from inside) is new; every
    pooled container was attached once (its stdin) and renamed at most once, to its one
    job: a trivial job ends before STUDIO_CODE_PREWARM_RENAME_AFTER_S (here its largest,
    1.5 s), under its pool name (an engine call fewer), so a loaded machine may rename
    some, never most (at 0.5 s, 11 of 49 were renamed beside a bench and -n 2 tests)."""
    from executor.runtimes.base import owner_id

    # Followed as they happen, from before the pool is filled (the engine keeps only its
    # last 256 events for a later query).
    stream = docker_client.api.events(
        decode=True, filters={"type": "container", "label": f"{LABEL_POOL}={owner_id()}"}
    )
    events: list[dict] = []
    reader = threading.Thread(target=lambda: events.extend(stream), daemon=True)
    reader.start()
    time.sleep(0.2)
    ex = pooled(code_prewarm_rename_after_s=1.5)
    pool = ex.runtime.pool
    results = [ex.run(CodeJob(code=WHOAMI, timeout_s=20)) for _ in range(50)]
    assert all(r.status is Status.SUCCEEDED for r in results), [r.error for r in results]
    assert not any(r.output["reused"] for r in results)
    ids = [r.output["cid"] for r in results]
    assert len(set(ids)) == 50, "a container ran two jobs"

    ex.close()  # the last replacement is removed: its events are in too
    time.sleep(0.5)
    stream.close()
    reader.join(5)
    attaches = Counter(e["id"] for e in events if e["Action"] == "attach")
    renames: dict[str, list[str]] = defaultdict(list)
    for e in events:
        if e["Action"] == "rename":
            renames[e["id"]].append(e["Actor"]["Attributes"]["name"])
    hits = [r for r in results if start_detail(r.trace) == "pool"]
    # A job waits for a container already starting rather than starting its own: on a
    # loaded machine one may still start cold (the wait is bounded), never most of them.
    assert len(hits) >= 40, f"only {len(hits)} of 50 jobs took a pre-started sandbox"
    for r in hits:
        cid = r.output["cid"]
        assert renames[cid] in ([], [f"studio-code-{r.job_id}"]), (cid, renames.get(cid))
        assert attaches[cid] == 1
    assert set(attaches.values()) == {1}, "a pre-started container was attached twice"
    assert all(len(names) <= 1 for names in renames.values())
    renamed = [cid for cid, names in renames.items() if names]
    assert len(renamed) <= len(hits) // 2, f"{len(renamed)} of {len(hits)} trivial jobs renamed"
    assert pool.hits["python"] == len(hits) and pool.misses["python"] == 50 - len(hits)


def test_a_pooled_job_that_runs_on_takes_its_name_and_any_process_kills_it(
    pooled: Any, docker_client: Any
) -> None:
    """A job still running STUDIO_CODE_PREWARM_RENAME_AFTER_S after it took a pre-started
    sandbox has it renamed ``studio-code-<job id>``: another process's ``kill(job_id)`` (a
    cancel's backstop, which comes 2 s after the revoke) finds it by that name, removes it."""
    from executor.service import make_runtime

    ex = pooled()
    job = CodeJob(code=WHOAMI, state_json=json.dumps({"mode": "sleep"}), timeout_s=30)
    done: list[Any] = []
    runner = threading.Thread(target=lambda: done.append(ex.run(job)), daemon=True)
    runner.start()
    named = wait_for(
        lambda: docker_client.api.containers(filters={"name": f"studio-code-{job.job_id}"}),
        10,
        "the pooled sandbox renamed after its job",
    )
    assert LABEL_POOL in named[0]["Labels"], named  # the pre-started one, not a cold one
    other = make_runtime(ex.settings)  # as the worker's main process: no pool, no map
    assert other is not None
    try:
        assert other.kill(job.job_id)
    finally:
        other.close()
    runner.join(30)
    # removed from outside, not by its own cancel: lost to the infrastructure, as it says
    assert done and done[0].status is Status.FAILED, done
    assert [r.detail for r in done[0].trace if r.step == "sandbox.lost"] == ["sandbox_vanished"]


def test_other_limits_start_cold_a_nodes_own_timeout_does_not(pooled: Any) -> None:
    from executor.languages import get_language

    ex = pooled()
    r = ex.run(CodeJob(code=WHOAMI, timeout_s=3))
    assert r.status is Status.SUCCEEDED and start_detail(r.trace) == "pool"
    assert ex.runtime.pool.wait_ready(60)
    before = ex.runtime.pool_stats()["languages"]["python"]
    limits = ex.limits(10).model_copy(update={"memory_bytes": 128 * 1024 * 1024})
    raw = ex.runtime.run(CodeJob(code=WHOAMI), get_language("python"), limits)
    assert raw.pooled is False and raw.exit_code == 0
    after = ex.runtime.pool_stats()["languages"]["python"]
    assert after["misses"] == before["misses"] + 1 and after["hits"] == before["hits"]
    assert after["idle"] == 1, "the pooled container stays for a job that matches"


def test_no_upkeep_while_a_job_is_on_its_callers_path(pooled: Any, docker_client: Any) -> None:
    """Inside ``on_path`` (a worker: claim to done notice) the pool starts no replacement
    and removes nothing; when the block ends it does both."""
    ex = pooled()
    pool = ex.runtime.pool
    owner = pool.owner
    with ex.on_path():
        r = ex.run(CodeJob(code=WHOAMI, timeout_s=20))
        assert r.status is Status.SUCCEEDED and start_detail(r.trace) == "pool"
        used = r.output["cid"]
        time.sleep(1.5)  # what the thread would have done by now, it must not have
        stats = pool.stats()["languages"]["python"]
        assert stats["idle"] == 0 and stats["starting"] == 0, stats
        ids = {c["Id"] for c in pool_containers(docker_client, owner)}
        assert ids == {used}, "no replacement yet, and the used sandbox not removed yet"
    assert pool.wait_settled(60)
    left = {c["Id"] for c in pool_containers(docker_client, owner)}
    assert used not in left and len(left) == 1, "replaced and removed once the block ended"
    again = ex.run(CodeJob(code=WHOAMI, timeout_s=20))
    assert start_detail(again.trace) == "pool" and again.output["cid"] in left


def _created_for(docker_client: Any, job_id: str, since: float) -> list[dict]:
    """Docker's create events, since ``since``, of a container labelled with ``job_id``."""
    events = docker_client.api.events(
        since=int(since) - 1,
        until=int(time.time()) + 1,
        filters={"type": "container", "event": "create", "label": f"studio.job_id={job_id}"},
        decode=True,
    )
    return list(events)


class _CancelAfter:
    """A ``should_cancel`` that says yes from its ``n``-th call on; counts its calls."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.calls >= self.n


def test_a_job_cancelled_before_its_sandbox_starts_makes_none(
    pooled: Any, docker_executor: Any, docker_client: Any
) -> None:
    """A job cancelled while it waits for a pre-started sandbox that is still starting, or
    before a cold one is created, ends cancelled at once: it takes nothing from the pool,
    no container is created for it (Docker's events say so), and the pool is unchanged."""
    since = time.time()
    # the events query finds a job's container: one that runs has exactly one create
    ran = docker_executor.run(CodeJob(code=WHOAMI, timeout_s=20))
    assert ran.status is Status.SUCCEEDED, ran.error
    # cold: no pool
    job = CodeJob(code=WHOAMI, timeout_s=20)
    r = docker_executor.run(job, should_cancel=lambda: True)
    assert r.status is Status.CANCELLED and r.error.code == "CODE_CANCELLED", r.error
    assert r.error.message == "Cancelled before its sandbox started."

    # pooled: the idle one is taken, and a replacement is "starting" (the pool's own count,
    # raised here inside on_path, so that no real start can end the wait first)
    ex = pooled()
    pool = ex.runtime.pool
    with ex.on_path():
        first = ex.run(CodeJob(code=WHOAMI, timeout_s=20))
        assert start_detail(first.trace) == "pool"
        with pool._cond:
            pool._starting["python"] += 1
        try:
            waiting = CodeJob(code=WHOAMI, timeout_s=20)
            watch = _CancelAfter(3)  # two slices of waiting, then cancelled
            r2 = ex.run(waiting, should_cancel=watch)
        finally:
            with pool._cond:
                pool._starting["python"] -= 1
        stats = pool.stats()["languages"]["python"]
    assert r2.status is Status.CANCELLED, r2.error
    assert r2.error.message == "Cancelled before its sandbox started."
    assert watch.calls == 3, "asked every slice while it waited, then stopped"
    assert stats["hits"] == 1 and stats["misses"] == 0, "a cancelled wait is not a miss"
    time.sleep(1)  # events are written as they happen; leave the engine a moment
    assert _created_for(docker_client, job.job_id, since) == []
    assert _created_for(docker_client, waiting.job_id, since) == []
    assert len(_created_for(docker_client, ran.job_id, since)) == 1


def test_idle_containers_past_the_bound_are_replaced(pooled: Any, docker_client: Any) -> None:
    ex = pooled(code_prewarm_max_idle_s=1)
    owner = ex.runtime.pool.owner
    first = {c["Id"] for c in pool_containers(docker_client, owner)}
    assert len(first) == 1

    def replaced() -> bool:
        now = {c["Id"] for c in pool_containers(docker_client, owner) if c["State"] == "running"}
        return (
            bool(now)
            and not (now & first)
            and not any(c["Id"] in first for c in pool_containers(docker_client, owner))
        )

    wait_for(replaced, 20, "the idle container replaced", interval_s=0.2)
    r = ex.run(CodeJob(code=WHOAMI))
    assert start_detail(r.trace) == "pool" and r.output["cid"] not in first


def test_a_new_image_id_drains_the_pool(
    pooled: Any,
    docker_client: Any,
    python_image: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    import executor.runtimes.docker.pool as pool_module

    monkeypatch.setattr(pool_module, "IMAGE_CHECK_S", 0.0)
    tag = f"studio-code-pooltest-{os.getpid()}:1"  # our own tag: the shared ones stay as they are
    docker_client.images.get(python_image).tag(tag)
    guard = None
    if THROUGH_SOCKGUARD:  # a guard takes its workers' images: this one has the test's tag
        guard = SockGuardProcess(tmp_path / "guard", env={"STUDIO_CODE_IMAGE": tag})
        monkeypatch.setenv("DOCKER_HOST", guard.host)
    ex = None
    try:
        ex = pooled(code_image=tag)
        owner = ex.runtime.pool.owner
        old = pool_containers(docker_client, owner)[0]
        rebuilt, _ = docker_client.images.build(
            fileobj=io.BytesIO(f"FROM {python_image}\nLABEL studio.test=pool-drain\n".encode()),
            tag=tag,
            rm=True,
        )
        assert rebuilt.id != old["ImageID"]

        def on_new_image() -> bool:
            cs = pool_containers(docker_client, owner)
            return bool(cs) and all(c["ImageID"] == rebuilt.id for c in cs)

        wait_for(on_new_image, 30, "the pool refilled from the new image", interval_s=0.2)
        r = ex.run(CodeJob(code=WHOAMI))
        assert start_detail(r.trace) == "pool" and r.output["cid"] != old["Id"]
    finally:
        if ex is not None:
            ex.close()  # before its guard goes
        if guard is not None:
            guard.stop()
        docker_client.images.remove(tag, noprune=False)


# --- what a stopping or dying process leaves ------------------------------------------------


def test_close_removes_idle_and_the_reaper_those_of_a_dead_owner(
    pooled: Any, make_settings: Any, python_image: str, docker_client: Any
) -> None:
    from executor.runtimes.docker.runtime import DockerRuntime

    ex = pooled()
    owner = ex.runtime.pool.owner
    assert len(pool_containers(docker_client, owner)) == 1
    ex.close()
    assert pool_containers(docker_client, owner) == []

    # A process with a filled pool is SIGKILLed: its idle sandboxes stay until a reaper
    # sees their owner is gone.
    script = (
        "import os, signal\n"
        "from executor.service import Executor\n"
        "from executor.settings import load_settings\n"
        f"ex = Executor(load_settings(enable_code_nodes=True, code_image={python_image!r}))\n"
        "ex.prepare()\n"
        "assert ex.runtime.pool.wait_ready(60)\n"
        "print(ex.runtime.pool.owner, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -9, proc.stderr
    dead = proc.stdout.strip()
    left = pool_containers(docker_client, dead)
    assert len(left) == 2, "python and typescript, idle"
    reaped = DockerRuntime(make_settings(code_image=python_image)).reap()
    assert sorted(reaped) == sorted(f"pool:{c['Names'][0].lstrip('/')}" for c in left)
    assert pool_containers(docker_client, dead) == []


def test_the_reaper_counts_a_live_owners_deadline_from_the_sandboxs_start(
    make_settings: Any, python_image: str, docker_client: Any
) -> None:
    """A sandbox's studio.deadline is written before it is made, while its node's timeout
    runs from its start: a start slower than the grace (a loaded host, gVisor's) must not
    let a reaper remove a sandbox of a live owner whose node is still within its timeout
    (a loaded CI run saw four runsc sandboxes "vanish" at once). Played with a real
    container whose start comes 8 s after it was made, its label 5 s after: still being
    started, it is left; started, its deadline moves by the 8 s; past that, it goes."""
    import uuid

    from executor.runtimes.base import owner_id
    from executor.runtimes.docker.runtime import DockerRuntime

    job_id = f"reap-start-{uuid.uuid4().hex[:12]}"
    made = time.time()
    label = int(made) + 5
    c = docker_client.containers.create(
        python_image,
        ["sleep", "120"],
        labels={"studio.owner": owner_id(), "studio.job_id": job_id, "studio.deadline": str(label)},
        network_disabled=True,
    )
    runtime = DockerRuntime(make_settings(code_image=python_image))
    try:
        wait_for(lambda: time.time() > label + 3, 20, "past its label")
        assert job_id not in runtime.reap(), "removed while its live owner was starting it"
        c.start()
        started = time.time()
        assert job_id not in runtime.reap(), (
            f"removed {time.time() - started:.1f} s after its start, its node's 5 s not over"
        )
        # its label moved by the start's delay (≥ 8 s): past that, any reaper removes it
        wait_for(lambda: time.time() > started + 6, 20, "past its moved deadline")
        runtime.reap()  # (another process's reaper may have removed it first: any may)
        with pytest.raises(Exception, match="404|No such container"):
            c.reload()
    finally:
        try:
            c.remove(force=True)
        except Exception:
            pass


def test_a_sandbox_started_aside_as_the_pool_closes_is_not_left_behind(
    pooled: Any, docker_client: Any
) -> None:
    """The pre-import measurement starts a bare twin beside the pool (``start_aside``) on a
    thread of its own: ``close`` waits until it is released and removes it; once closing, the
    pool starts none (a CI run found one left behind: the measurement asked ``closing()``,
    then the pool closed and drained, then the twin was started)."""
    from executor.errors import RuntimeUnavailable

    ex = pooled()  # no pre-import: the pool's own measurement starts no twin here
    pool = ex.runtime.pool
    bare = pool.start_aside("python")
    assert {c["Id"] for c in pool_containers(docker_client, pool.owner)} >= {bare.cid}
    closer = threading.Thread(target=ex.close, name="test-close")
    closer.start()
    closer.join(2.0)
    assert closer.is_alive(), "close returned while a sandbox started aside was out"
    with pytest.raises(RuntimeUnavailable, match="closing"):
        pool.start_aside("python")
    pool.release(bare)
    closer.join(60)
    assert not closer.is_alive()
    assert pool_containers(docker_client, pool.owner) == []


def test_meta_shows_the_pool(pooled: Any) -> None:
    from executor.meta import runtime_meta

    ex = pooled()
    runtime_meta(ex)  # its readiness probe runs the test program: in a pooled sandbox too
    assert ex.runtime.pool.wait_ready(60)
    ex.run(CodeJob(code=WHOAMI))
    assert ex.runtime.pool.wait_ready(60)
    pool = runtime_meta(ex)["pool"]  # the probe's result is cached: no third sandbox
    assert pool["prewarm"] == 1 and pool["max_idle_s"] == 300
    py = pool["this_process"]["languages"]["python"]
    assert (py["idle"], py["hits"], py["misses"]) == (1, 2, 0)
    assert py["oldest_idle_s"] >= 0


def test_pool_metrics_count_hits_and_misses_and_show_idle() -> None:
    from prometheus_client import REGISTRY

    from worker.metrics import record_pool

    def value(name: str) -> float:
        return REGISTRY.get_sample_value(name, {"language": "typescript"}) or 0.0

    hits0, misses0 = value("studio_code_pool_hits_total"), value("studio_code_pool_misses_total")
    stats = {"languages": {"typescript": {"idle": 1, "hits": 3, "misses": 1, "oldest_idle_s": 4.5}}}
    record_pool(stats)
    record_pool(stats)  # cumulative figures: seen twice, counted once
    assert value("studio_code_pool_hits_total") - hits0 == 3
    assert value("studio_code_pool_misses_total") - misses0 == 1
    assert value("studio_code_pool_idle") == 1
    assert value("studio_code_pool_idle_age_seconds") == 4.5


# --- in a real worker ---------------------------------------------------------------------


@pytest.mark.redis
@pytest.mark.timeout(240)
def test_worker_pool_cancel_timeout_oom_sigkill_and_stop_leave_nothing_reuse_nothing(
    make_stack: Any,  # noqa: F811 - the fixture imported above
    docker_client: Any,
    make_settings: Any,
) -> None:
    q: Stack = make_stack(
        code_concurrency=1, code_memory="64m", code_languages="python", queue_test_slots=0
    )
    w = q.start_worker("pool1", 1)
    [slot] = children(w.pid)
    owner = f"{os.uname().nodename}:{slot}"
    wait_for(lambda: pool_containers(docker_client, owner), 60, "the slot's idle sandbox")

    def gone(cid: str) -> bool:  # by id: a short job's sandbox keeps its pool name
        return not docker_client.api.containers(all=True, filters={"id": cid})

    seen: list[str] = []
    # cancel
    spin = q.client.submit(WHOAMI, "python", {"mode": "spin"})
    wait_for(
        lambda: docker_client.api.containers(
            filters={"name": f"studio-code-{spin}", "status": "running"}
        ),
        60,
        "the spin running",
    )
    time.sleep(0.3)
    assert q.client.cancel(spin) in ("cancelling", "cancelled")
    rec = q.client.wait(spin, 30)
    assert rec.status == "cancelled", rec
    seen.append(cid_in_logs(rec.logs))
    # timeout, OOM, a normal run
    late = q.client.submit(WHOAMI, "python", {"mode": "sleep"}, timeout_s=1)
    rec = q.client.wait(late, 30)
    assert rec.status == "timed_out" and rec.error.code == "CODE_TIMEOUT", rec
    seen.append(cid_in_logs(rec.logs))
    hog = q.client.submit(WHOAMI, "python", {"mode": "oom"}, timeout_s=20)
    rec = q.client.wait(hog, 30)
    assert rec.error is not None and rec.error.code == "CODE_MEMORY", rec
    seen.append(cid_in_logs(rec.logs))
    ok = q.client.submit(WHOAMI, "python", {})
    rec = q.client.wait(ok, 30)
    assert rec.status == "succeeded" and rec.output["reused"] is False, rec
    seen.append(rec.output["cid"])
    for job_id, cid in zip((spin, late, hog, ok), seen, strict=True):
        assert start_detail(q.client.status(job_id).trace) == "pool"
        wait_for(lambda c=cid: gone(c), 10, f"the sandbox of {job_id} removed")
    assert len(set(seen)) == 4, "a container ran two jobs"

    # SIGKILL with an idle pre-started sandbox: it stays until the reaper sees its owner gone
    idle = wait_for(lambda: pool_containers(docker_client, owner), 60, "a new idle sandbox")
    assert {c["Id"] for c in idle}.isdisjoint(seen)
    w.kill_hard()
    # a SIGKILL is delivered, not awaited: the reaper judges the owner by its pid, so the
    # sweep below starts once the pool process is gone (a CI run's sweep found it still
    # there and rightly removed nothing)
    from executor.runtimes.base import pid_alive

    wait_for(lambda: not pid_alive(slot), 30, "the killed pool process gone")
    left = {c["Names"][0].lstrip("/") for c in pool_containers(docker_client, owner)}
    assert idle[0]["Names"][0].lstrip("/") in left, "the idle sandbox outlived its owner"
    from worker.upkeep.janitor import Janitor

    janitor = Janitor(q.settings, "reaper@test")
    try:
        # every pre-started sandbox of the dead owner: the idle one, and any the pool had
        # started beside it by then (the pre-import measurement's bare twin: a CI run saw
        # two). Other tests' dead owners on this engine may be reaped in the same sweep.
        reaped = janitor.reap_sandboxes()
        assert {f"pool:{name}" for name in left} <= set(reaped), (left, reaped)
    finally:
        janitor.store.close()
    assert pool_containers(docker_client, owner) == []

    # A worker that stops removes its idle sandboxes itself.
    w2 = q.start_worker("pool2", 1)
    [slot2] = children(w2.pid)
    owner2 = f"{os.uname().nodename}:{slot2}"
    wait_for(lambda: pool_containers(docker_client, owner2), 60, "the slot's idle sandbox")
    w2.stop()
    assert pool_containers(docker_client, owner2) == []


@pytest.mark.timeout(300)
def test_a_pool_process_recycled_after_max_tasks_per_child_hands_over_cleanly(
    make_stack: Any,
    docker_client: Any,
) -> None:
    """Celery's ``--max-tasks-per-child``, given to ``studio-code worker`` (an operator's bound
    on a slow leak in a library a worker runs for weeks): each pool process ends after N jobs
    and a new one takes its slot. A backlog's every job ends exactly once, succeeded, in a
    container of its own; a process that ends removes its own pre-started sandbox itself (it
    is not left to the reaper) and the new one pre-starts its own."""
    q: Stack = make_stack(code_concurrency=1, code_languages="python", queue_test_slots=0)
    w = q.start_worker("recycle", 1, cli=True, extra_args=["--max-tasks-per-child", "3"])
    jobs = [q.client.submit(WHOAMI, "python", {}) for _ in range(10)]
    recs = q.wait_all(jobs, 240)
    ended = Counter(rec.status for rec in recs.values())
    assert ended == {Status.SUCCEEDED: 10}, (ended, w.tail(40))
    assert [q.done_count(j) for j in jobs] == [1] * 10, "a job ended other than once"
    cids = [recs[j].output["cid"] for j in jobs]
    assert len(set(cids)) == 10 and not any(recs[j].output["reused"] for j in jobs)
    pids = {int(recs[j].worker.rsplit(":", 1)[1]) for j in jobs}  # type: ignore[union-attr]
    assert len(pids) >= 4, f"10 jobs at 3 per process ran in {sorted(pids)}"
    host = os.uname().nodename

    # the process that ran the last 1-3 jobs is replaced only by the next job; every process
    # that ended is gone with its idle sandbox, and the live slot has its own
    ended_pids = {p for p in pids if not Path(f"/proc/{p}").exists()}
    assert len(ended_pids) >= 3, (sorted(pids), children(w.pid))

    def only_live_owners() -> bool:
        owners = {
            c["Labels"][LABEL_POOL]
            for c in docker_client.api.containers(all=True, filters={"label": LABEL_POOL})
        }
        return not owners & {f"{host}:{p}" for p in ended_pids}

    wait_for(only_live_owners, 10, "the ended pool processes' sandboxes removed by them")
    # a job's sandbox is removed after its result is written: through a socket guard the
    # removal can land a moment after the job reads as ended
    for job_id in jobs:
        wait_for(
            lambda job_id=job_id: (
                not docker_client.api.containers(
                    all=True, filters={"name": f"studio-code-{job_id}"}
                )
            ),
            10,
            f"the sandbox of {job_id} removed",
        )
    live = [p for p in children(w.pid) if Path(f"/proc/{p}").exists()]
    assert len(live) == 1, live
    wait_for(
        lambda: pool_containers(docker_client, f"{host}:{live[0]}"), 60, "the live slot's sandbox"
    )
    assert "Traceback" not in w.tail(400), w.tail(60)
    w.stop()
    assert pool_containers(docker_client, f"{host}:{live[0]}") == []


def _sockets(pid: int) -> set[str]:
    """The socket inodes ``pid`` holds open (``socket:[N]`` of /proc/PID/fd)."""
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:"):
            found.add(target)
    return found


@pytest.mark.timeout(300)
def test_a_replaced_pool_process_holds_none_of_its_main_processs_sockets(
    make_stack: Any, docker_client: Any
) -> None:
    """A pool process forked to replace one (here: SIGKILLed, as the soak does) starts with
    a copy of every socket its main process has open (Redis, the store, the engine, the
    /metrics listener) and, before worker/job/forked.py, kept them for its whole life: the
    worker's tree grew by them with each replacement. The new process shares none of its
    main process's sockets, and runs jobs."""
    import signal as sig

    q: Stack = make_stack(
        code_concurrency=1,
        code_languages="python",
        queue_test_slots=0,
        queue_reap_interval_s=2,  # the killed process's idle sandbox is the reaper's
    )
    w = q.start_worker("forked", 1, cli=True)
    first = q.client.submit(WHOAMI, "python", {})
    assert q.wait_all([first], 60)[first].status == Status.SUCCEEDED
    time.sleep(2)  # the main process's heartbeat, gate and upkeep have their connections
    [old] = children(w.pid)
    main_sockets = _sockets(w.pid)
    assert len(main_sockets) >= 5, main_sockets  # broker, Redis, engine, listener...
    os.kill(old, sig.SIGKILL)  # the test's own worker's pool process
    wait_for(lambda: [p for p in children(w.pid) if p != old], 30, "a new pool process")
    [new] = [p for p in children(w.pid) if p != old]
    jobs = [q.client.submit(WHOAMI, "python", {}) for _ in range(3)]
    recs = q.wait_all(jobs, 120)
    assert {r.status for r in recs.values()} == {Status.SUCCEEDED}, w.tail(40)
    assert {int(r.worker.rsplit(":", 1)[1]) for r in recs.values()} == {new}  # type: ignore[union-attr]
    shared = _sockets(new) & (main_sockets | _sockets(w.pid))
    print(f"\nmain {len(_sockets(w.pid))} sockets, new pool process {len(_sockets(new))}")
    assert not shared, f"the new pool process holds {len(shared)} of its main process's sockets"
    host = os.uname().nodename
    wait_for(lambda: not pool_containers(docker_client, f"{host}:{old}"), 60, "the reaper's round")
    assert "Traceback" not in w.tail(400), w.tail(60)
    w.stop()


def test_an_oci_runtime_the_engine_does_not_know_is_not_ready_and_says_so(
    make_settings: Any, python_image: str
) -> None:
    from executor.languages import get_language
    from executor.service import Executor

    ex = Executor(make_settings(code_image=python_image, code_oci_runtime="no-such-oci"))
    ready = ex.readiness(get_language("python"), fresh=True)
    assert not ready.ready
    assert "STUDIO_CODE_OCI_RUNTIME='no-such-oci'" in ready.reason and "runc" in ready.reason


# --- the engine client of a pool process ----------------------------------------------------

ENGINE_CALLS = """
import json, os, sys, uuid
from executor.runtimes.docker.client import shared_api

def sockets():
    out = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            out += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return out

api = shared_api()
before = sockets()
host_config = api.create_host_config(network_mode="none")
made = []
try:
    for _ in range(12):  # what a pre-started sandbox's life asks of the engine
        cid = api.create_container(
            sys.argv[1], command=["true"], host_config=host_config,
            name=f"studio-code-conntest-{uuid.uuid4().hex[:12]}",
            labels={"studio.test": "engine-connections"},
        )["Id"]
        made.append(cid)
        sock = api.attach_socket(cid, params={"stdin": 1, "stdout": 1, "stream": 1})
        api.start(cid)
        api.rename(cid, f"studio-code-conntest-{uuid.uuid4().hex[:12]}")
        assert api.wait(cid, timeout=30)["StatusCode"] == 0
        sock._sock.close()
        sock.close()
        api.remove_container(cid, force=True)
        made.remove(cid)
finally:
    for cid in made:
        api.remove_container(cid, force=True)
print(json.dumps({"sockets": sockets() - before, "trust_env": api.trust_env}))
"""


def test_the_engine_client_keeps_one_pool_of_connections_for_all_containers(
    docker_client: Any, python_image: str
) -> None:
    """A pooled job's engine calls (create, attach, start, rename, wait, remove) each name a
    container the client never named before. The SDK as it comes keeps a connection pool per
    URL, so each call opened a new connection, and up to 25 stayed open, idle; the shared
    client keeps one pool for the engine's socket (runtimes/docker/client.py's _lighten). 12
    sandbox lives in a process of its own, on the engine's own socket (a socket guard would refuse
    these containers, which are not made by sandbox_policy; through a guard the client's
    connections are the same): every call answers, and the process then holds at most 2
    sockets more than before (on the SDK as it comes: one per container, 12 or more)."""
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE_CALLS, python_image],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=180,
        env={**os.environ, "PYTHONPATH": str(ROOT), "DOCKER_HOST": REAL_DOCKER_HOST},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["sockets"] <= 2, seen
    # a local socket is never reached through an HTTP proxy: its variables are not read
    assert seen["trust_env"] is False
    left = docker_client.api.containers(
        all=True, filters={"label": "studio.test=engine-connections"}
    )
    assert left == []


def test_the_default_renames_a_taken_sandbox_however_soon_its_job_ends() -> None:
    """With STUDIO_CODE_PREWARM_RENAME_AFTER_S=0 (the default) the rename (what removes an
    earlier attempt's sandbox of the same job: test_infra_lost's re-run test, on a real
    engine) happens even when the job ended before the rename's thread ran; above 0 a job
    that ended first is never renamed. The rule alone, on the renamer's own thread body."""
    from types import SimpleNamespace

    from executor.runtimes.docker.pool import _Renamer

    for after, expected in ((0.0, ["job-1"]), (0.5, [])):
        renamed: list[str] = []
        pool = SimpleNamespace(
            settings=SimpleNamespace(code_prewarm_rename_after_s=after),
            _rename=lambda p, job_id, renamed=renamed: renamed.append(job_id),
        )
        r = _Renamer.__new__(_Renamer)
        r.pool, r.p, r.job_id, r.error = pool, None, "job-1", None  # type: ignore[assignment]
        r._ended = threading.Event()
        r._ended.set()  # the job ended before the thread ran
        r._run()
        assert renamed == expected, (after, renamed)
