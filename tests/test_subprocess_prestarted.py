"""Pre-started subprocess runners (STUDIO_CODE_PREWARM in the subprocess runtime): one job
each, never a dead one, replaced off the job's path, and nothing left when the process
closes. What they keep apart is the isolation suite's, run against them too."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from executor.models import CodeJob, Status
from executor.runtimes.subprocess.prestarted import Runner
from executor.service import Executor

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/stat"), reason="pre-started runners are Linux only"
)

PID = "import os\ndef main(state):\n    return os.getpid()\n"


@pytest.fixture
def make_prepared(make_settings) -> Iterator:  # type: ignore[no-untyped-def]
    made: list[Executor] = []

    def make(**overrides: object) -> Executor:
        settings = {"code_runtime": "subprocess", "code_languages": "python", "code_prewarm": 1}
        ex = Executor(make_settings(**{**settings, **overrides}))
        made.append(ex)
        ex.prepare()
        assert ex.runtime.pool.wait_ready(30)  # type: ignore[union-attr]
        return ex

    yield make
    for ex in made:
        ex.close()


def idle(ex: Executor) -> list[Runner]:
    pool = ex.runtime.pool  # type: ignore[union-attr]
    with pool._cond:
        return list(pool._idle["python"])


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def held_by(runner: Runner) -> list[Path]:
    """What a runner holds on the host: its workdir, its cgroup's folders."""
    dirs = [Path(runner.workdir)]
    if runner.group is not None:
        dirs += list(runner.group.dirs.values())
    return dirs


def test_each_job_gets_a_runner_of_its_own_started_before_it(make_prepared) -> None:  # type: ignore[no-untyped-def]
    ex = make_prepared()
    seen = []
    for _ in range(3):
        waiting = idle(ex)
        assert len(waiting) == 1
        r = ex.run(CodeJob(code=PID, timeout_s=10))
        assert r.status is Status.SUCCEEDED, r.error
        seen.append(r.output)
        assert r.output == waiting[0].runner_pid()  # the one that waited ran it
        assert not alive(r.output)  # and is gone with its job
        assert ex.runtime.pool.wait_ready(30)  # type: ignore[union-attr]
    assert len(set(seen)) == 3
    stats = ex.runtime.pool_stats()["languages"]["python"]  # type: ignore[index]
    assert stats["hits"] == 3 and stats["misses"] == 0


def test_a_runner_that_died_while_waiting_is_never_handed_out(make_prepared) -> None:  # type: ignore[no-untyped-def]
    ex = make_prepared()
    (dead,) = idle(ex)
    os.kill(dead.child.pid, signal.SIGKILL)
    dead.child.wait()
    r = ex.run(CodeJob(code=PID, timeout_s=10))
    assert r.status is Status.SUCCEEDED, r.error
    assert r.output != dead.child.pid
    assert ex.runtime.pool.wait_ready(30)  # type: ignore[union-attr]
    (fresh,) = idle(ex)
    assert fresh is not dead and alive(fresh.child.pid)
    deadline = time.monotonic() + 10
    while any(p.exists() for p in held_by(dead)) and time.monotonic() < deadline:
        time.sleep(0.05)  # the pool's thread ends it off the job's path
    assert not [p for p in held_by(dead) if p.exists()]


def test_the_replacement_starts_after_the_jobs_path(make_prepared) -> None:  # type: ignore[no-untyped-def]
    ex = make_prepared()
    with ex.on_path():
        r = ex.run(CodeJob(code=PID, timeout_s=10))
        assert r.status is Status.SUCCEEDED, r.error
        time.sleep(0.3)  # a replacement started beside the job would be under way by now
        stats = ex.runtime.pool_stats()["languages"]["python"]  # type: ignore[index]
        assert stats["idle"] == 0 and stats["starting"] == 0, stats
    assert ex.runtime.pool.wait_ready(30)  # type: ignore[union-attr]


def test_an_idle_runner_past_its_bound_is_replaced(make_prepared) -> None:  # type: ignore[no-untyped-def]
    ex = make_prepared(code_prewarm_max_idle_s=0.5)
    (old,) = idle(ex)
    deadline = time.monotonic() + 15
    while alive(old.child.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(old.child.pid)
    assert ex.runtime.pool.wait_ready(30)  # type: ignore[union-attr]
    assert idle(ex)[0] is not old


def test_close_kills_idle_runners_and_releases_what_they_hold(make_prepared) -> None:  # type: ignore[no-untyped-def]
    ex = make_prepared(code_prewarm=2)
    runners = idle(ex)
    assert len(runners) == 2 and all(p.exists() for r in runners for p in held_by(r))
    ex.close()
    for r in runners:
        assert not alive(r.child.pid)
        assert not [p for p in held_by(r) if p.exists()]
    if os.getuid() == 0:  # their uid leases are free again, and marked clean
        from executor.runtimes.subprocess.uids import UidPool

        leased = {r.lease.uid for r in runners if r.lease is not None}
        assert len(leased) == 2
        pool = UidPool(ex.settings.subprocess_uids)
        for uid in leased:
            lease = pool._try(uid)
            assert lease is not None and not lease.was_dirty, uid
            lease.release()
