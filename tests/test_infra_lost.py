"""Infrastructure or code, told apart on the machine's Docker engine (the engine itself going
away is tests/test_two_hosts.py, on an engine of the test's own): a sandbox removed from
outside while it runs (not by a cancel) is lost to the infrastructure, never the code's, and
so is one the engine was asked to signal (`docker kill`, `docker stop`); a sandbox whose
code ends its own process with the very status a kill gives (137) stays the code's, because
its engine still takes new connections and was asked to signal nothing. Cold and pre-started
sandboxes."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from executor.models import CodeJob
from testkit.sandboxes import run_and_end_from_outside

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
def test_a_job_whose_sandbox_an_operator_kills_runs_again_and_succeeds(
    make_stack: Any, docker_client: Any
) -> None:
    """One worker; the job's first sandbox is `docker kill`ed (the test's own container) while
    its code runs: the job is handed back, runs again and ends ``succeeded`` with attempts
    2, its trace beginning with the re-run row naming ``sandbox_killed``; no sandbox is left."""
    q = make_stack(code_concurrency=1)
    q.start_worker("killed", concurrency=1)
    code = "import time\n\ndef main(state):\n    time.sleep(2)\n    return 5\n"
    job = q.client.submit(code, "python", {}, timeout_s=25)
    killed: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not killed:
        for c in docker_client.containers.list(filters={"name": f"studio-code-{job}"}):
            time.sleep(0.3)  # its code is sleeping now
            c.kill()
            killed.append(c.id)
        time.sleep(0.05)
    r = q.client.wait(job, 60)
    print(f"\nkilled {killed}; {r.status.value} {r.attempts} {r.error} {r.trace}")
    assert killed, "the job's sandbox never ran"
    assert r.status.value == "succeeded" and r.output == 5, (r.status, r.error)
    assert r.attempts == 2, r
    assert r.trace[0].step == "job.rerun" and "sandbox_killed" in r.trace[0].detail, r.trace
    assert not docker_client.containers.list(all=True, filters={"id": killed[0]})


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
