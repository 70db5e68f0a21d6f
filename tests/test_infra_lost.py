"""Infrastructure or code, told apart on the machine's Docker engine (the engine itself going
away is tests/test_two_hosts.py, on an engine of the test's own): a sandbox removed from
outside while it runs (not by a cancel) is lost to the infrastructure, never the code's, and
so is one the engine was asked to signal (`docker kill`, `docker stop`); a sandbox whose
code ends its own process with the very status a kill gives (137) stays the code's, because
its engine still takes new connections and was asked to signal nothing. Cold and pre-started
sandboxes."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from executor.models import CodeJob
from testkit.sandboxes import run_and_end_from_outside
from tests.conftest import run_cli

pytestmark = pytest.mark.docker

SLEEPS = "import time\n\ndef main(state):\n    time.sleep(20)\n    return 1\n"
EXITS_137 = "import os\n\ndef main(state):\n    os._exit(137)\n"


@pytest.fixture(params=["cold", "pool"])
def executor(request: pytest.FixtureRequest, docker_executor: Any) -> Any:
    if request.param == "pool":
        return request.getfixturevalue("docker_pool_executor")
    return docker_executor


def test_a_sandbox_removed_from_outside_is_not_the_codes(executor: Any, docker_client: Any) -> None:
    # what an operator's `docker rm -f` does
    r = run_and_end_from_outside(executor, docker_client, lambda c: c.remove(force=True))
    print(f"\n{r.status.value} {r.error} {[(t.step, t.detail) for t in r.trace]}")
    assert r.status.value == "failed" and r.error is not None, r
    assert r.error.code == "RUNTIME_UNAVAILABLE", r.error
    assert "not to its code" in r.error.message and "sandbox_vanished" in r.error.message
    assert [(t.step, t.detail) for t in r.trace] == [("sandbox.lost", "sandbox_vanished")]


@pytest.mark.parametrize(
    "how",
    [
        "kill",  # `docker kill`: SIGKILL, exit status 137
        "stop",  # `docker stop -t 1`: SIGTERM (PID 1 ignores it), a second later SIGKILL
        "kill-TERM",  # `docker kill -s TERM`, then `docker kill`: two kill events
    ],
)
def test_a_sandbox_signalled_through_the_engine_is_not_the_codes(
    executor: Any, docker_client: Any, how: str
) -> None:
    def end(c: Any) -> None:
        if how == "kill":
            c.kill()
        elif how == "stop":
            c.stop(timeout=1)
        else:
            c.kill(signal="SIGTERM")
            time.sleep(0.3)
            c.kill()

    r = run_and_end_from_outside(executor, docker_client, end)
    print(f"\n{how}: {r.status.value} {r.error} {[(t.step, t.detail) for t in r.trace]}")
    assert r.status.value == "failed" and r.error is not None, r
    assert r.error.code == "RUNTIME_UNAVAILABLE", r.error
    assert "not to its code" in r.error.message and "sandbox_killed" in r.error.message
    assert "exit status 137" in r.error.message and "signal" in r.error.message, r.error
    assert [(t.step, t.detail) for t in r.trace] == [("sandbox.lost", "sandbox_killed")]


def test_code_that_exits_137_itself_is_still_the_codes(executor: Any) -> None:
    r = executor.run(CodeJob(code=EXITS_137, timeout_s=20))
    assert r.status.value == "failed" and r.error is not None, r
    assert r.error.code == "CODE_ERROR", r.error
    assert "exit status 137" in r.error.message, r.error
    assert [t.step for t in r.trace] == ["sandbox.start", "code.run"]


def test_the_result_says_its_sandbox_was_lost_or_ran_as_typed_facts(
    docker_executor: Any, docker_client: Any
) -> None:
    """What became of the sandbox is typed on the result (the job path decides on it,
    worker.job.rerun): lost and its cause, or the code ran. The trace only shows it (a
    result without its trace still says it) and the result's JSON is unchanged."""
    r = run_and_end_from_outside(docker_executor, docker_client, lambda c: c.remove(force=True))
    assert (r.lost, r.started, r.refused) == ("sandbox_vanished", False, None), r
    assert r.model_copy(update={"trace": []}).lost == "sandbox_vanished"
    assert not {"lost", "started", "refused"} & set(r.model_dump(mode="json"))
    ran = docker_executor.run(CodeJob(code=EXITS_137, timeout_s=20))
    assert (ran.lost, ran.started, ran.refused) == (None, True, None), ran


@pytest.mark.redis
def test_a_job_lost_on_every_attempt_ends_runtime_unavailable_naming_each_cause(
    make_stack: Any, docker_client: Any
) -> None:
    """One worker; the job's sandbox is removed from outside on each attempt (`docker rm -f`
    of the test's own container): it is handed back and runs again, twice, then ends
    ``failed`` RUNTIME_UNAVAILABLE with every cause named, attempts 3 (MAX_ATTEMPTS), never
    a CODE_* outcome; its trace begins with the re-run row."""
    from worker.protocol import MAX_ATTEMPTS

    q = make_stack(code_concurrency=1)
    q.start_worker("lost", concurrency=1)
    job = q.client.submit(SLEEPS, "python", {}, timeout_s=25)
    removed: list[str] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not q.client.status(job).status.finished:
        running = [
            c
            for c in docker_client.containers.list(filters={"name": f"studio-code-{job}"})
            if c.id not in removed
        ]
        for c in running:
            time.sleep(0.3)  # its code is sleeping now
            c.remove(force=True)
            removed.append(c.id)
        time.sleep(0.05)
    r = q.client.wait(job, 30)
    print(f"\nremoved {len(removed)} sandboxes; {r.status.value} {r.attempts} {r.error}")
    assert len(removed) == MAX_ATTEMPTS, removed
    assert r.status.value == "failed" and r.error is not None, r
    assert r.error.code == "RUNTIME_UNAVAILABLE", r.error
    assert r.attempts == MAX_ATTEMPTS, r
    assert r.error.message.count("sandbox_vanished") == MAX_ATTEMPTS, r.error.message
    assert f"It was attempt {MAX_ATTEMPTS}, the last" in r.error.message, r.error.message
    assert [t.step for t in r.trace] == ["job.rerun", "sandbox.lost"], r.trace


@pytest.mark.redis
def test_a_job_whose_sandbox_an_operator_kills_runs_again_its_live_logs_marking_the_rerun(
    make_stack: Any, docker_client: Any
) -> None:
    """One worker; the job prints (a random word: each attempt its own) and sleeps; its first
    sandbox is `docker kill`ed (the test's own container) once that text is in the live
    stream: the job is handed back, runs again and ends ``succeeded`` with attempts 2, its
    trace beginning with the re-run row naming ``sandbox_killed``; no sandbox is left. The
    re-run's text comes after a ``rerun`` event with attempt 2, in the API's SSE stream, in
    ``CodeClient.follow_logs`` and in ``studio-code logs --follow`` (a line between the two),
    and the text after the boundary is the stored logs (the attempt that counts)."""
    from api_client.http.docs import USER_HEADER
    from testkit.api import read_sse
    from worker.protocol import logs_key

    q = make_stack(code_concurrency=1)
    q.start_worker("rerun", concurrency=1)
    q.start_api()
    code = (
        "import os, time\n\ndef main(state):\n"
        "    print('hello from', os.urandom(8).hex(), flush=True)\n"
        "    time.sleep(2)\n    return 5\n"
    )
    user = "rerun-user"
    r = q.http.post("/api/runs", json={"code": code}, headers={USER_HEADER: user})
    assert r.status_code == 202, r.text
    job = r.json()["job_id"]
    killed: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not killed:
        if q.client.redis.xlen(logs_key(job)):  # attempt 1 has printed: it sleeps now
            for c in docker_client.containers.list(filters={"name": f"studio-code-{job}"}):
                c.kill()
                killed.append(c.id)
        time.sleep(0.05)
    assert killed, "the job's first sandbox never printed"
    events = read_sse(q.http, f"/api/runs/{job}/logs?follow=1", {USER_HEADER: user})
    rec = q.client.wait(job, 60)
    print(f"\nkilled {killed}; {rec.status.value} {rec.attempts} {rec.error} {rec.trace}")
    assert rec.status.value == "succeeded" and rec.output == 5, (rec.status, rec.error)
    assert rec.attempts == 2, rec
    assert rec.trace[0].step == "job.rerun" and "sandbox_killed" in rec.trace[0].detail
    assert not docker_client.containers.list(all=True, filters={"id": killed[0]})
    print(events)
    kinds = [e for e, _, _ in events]
    assert kinds.count("rerun") == 1 and kinds[-1] == "end", events
    at = kinds.index("rerun")
    assert json.loads(events[at][1]) == {"attempt": 2}, events
    assert set(kinds[:at]) == set(kinds[at + 1 : -1]) == {"log"}, events
    first = "".join(d for _, d, _ in events[:at])
    second = "".join(d for _, d, _ in events[at + 1 : -1])
    assert first.startswith("hello from") and second.startswith("hello from"), events
    assert first != second and second == rec.logs, (first, second, rec.logs)
    # the client's follow (Redis directly) gives the same events
    followed = [(e.event, e.data) for e in q.client.follow_logs(job, timeout_s=30)]
    assert followed == [(e, d) for e, d, _ in events], followed
    # the CLI prints the boundary between the two attempts' text
    out = run_cli("logs", job, "--follow", "--timeout", "30", env=q.env(), timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stderr.index(first) < out.stderr.index("attempt 2 starts here")
    assert out.stderr.index("attempt 2 starts here") < out.stderr.index(second), out.stderr


def test_a_rerun_waits_for_the_earlier_attempts_sandbox_to_be_removed(
    executor: Any, docker_client: Any, python_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A re-run on the same engine finds its job's name still held by the earlier attempt's
    sandbox, whose removal another thread has under way (a lost sandbox is removed off its
    attempt's path): the engine answers the new attempt's remove with 409 ("already in
    progress") and its create or rename with 409 (name in use). The new attempt waits for
    the name and runs; it does not fail. (The soak saw one such job fail: "The container
    name ... is already in use".) The concurrent removal is played for real: the runtime's
    first remove of the old sandbox is taken by a thread of the test's own, which removes it
    half a second later, as the engine's own removal would end."""
    from executor.runtimes.docker.runtime import DockerRuntime

    job = CodeJob(code="def main(state):\n    return 7\n", timeout_s=20)
    old = docker_client.containers.create(
        python_image,
        ["sleep", "60"],
        name=f"studio-code-{job.job_id}",
        labels={"studio.owner": "test:1", "studio.job_id": job.job_id, "studio.deadline": "0"},
        network_disabled=True,
    )
    real_remove = DockerRuntime.remove
    taken: list[threading.Thread] = []

    def remove(api: Any, cid: str) -> bool:
        if cid in (old.id, old.name, f"studio-code-{job.job_id}"):
            if not taken:  # another process takes its removal, done half a second later
                t = threading.Thread(target=lambda: (time.sleep(0.5), real_remove(api, old.id)))
                taken.append(t)
                t.start()
            if taken[0].is_alive():  # the engine: "removal already in progress" (409)
                return False
        return real_remove(api, cid)

    monkeypatch.setattr(DockerRuntime, "remove", staticmethod(remove))
    try:
        r = executor.run(job)
    finally:
        for t in taken:
            t.join(10)
        try:
            old.remove(force=True)
        except Exception:
            pass
    assert taken, "the runtime never asked to remove the earlier attempt's sandbox"
    assert r.status.value == "succeeded" and r.output == 7, (r.status, r.error)


@pytest.mark.parametrize("cancelled", [False, True])
def test_a_sandbox_removed_between_its_create_and_start_is_lost_or_its_cancels(
    docker_executor: Any, docker_client: Any, monkeypatch: pytest.MonkeyPatch, cancelled: bool
) -> None:
    """Removed from outside after the engine made it and before it started (an operator's
    `docker rm -f`, a reaper; or the job's own cancel): the engine answers the start 404, or
    409 "marked for removal" while the removal is under way. Either is the infrastructure's
    loss (run again), never a refusal a re-run would meet (a CI run saw the hostile battery's
    job end "refused" on that 409); when the job's cancel was asked, it ends cancelled. The
    removal is the real engine's, done just before the real start call."""
    api = docker_executor.runtime.api
    real_start = api.start
    removed: list[str] = []

    def start(cid: str, *args: Any, **kwargs: Any) -> Any:
        docker_client.api.remove_container(cid, force=True)
        removed.append(cid)
        return real_start(cid, *args, **kwargs)

    monkeypatch.setattr(api, "start", start)
    job = CodeJob(code="def main(state):\n    return 1\n", timeout_s=20)
    r = docker_executor.run(job, should_cancel=lambda: cancelled and bool(removed))
    assert removed, "the start was never called"
    if cancelled:
        assert (r.status.value, r.error.code) == ("cancelled", "CODE_CANCELLED"), r
        assert r.lost is None
        return
    assert (r.status.value, r.error.code) == ("failed", "RUNTIME_UNAVAILABLE"), r
    assert r.lost == "sandbox_vanished" and r.refused is None, r
    assert [(t.step, t.detail) for t in r.trace] == [("sandbox.lost", "sandbox_vanished")]
