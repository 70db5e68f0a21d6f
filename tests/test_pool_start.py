"""A worker takes jobs only once its pool processes have started (worker/pool_start.py): one
whose pool process is stuck at start (testkit/hang_app.py: it hangs before the studio's own
start) is never announced, answers no ping, and stops itself with an error naming
STUDIO_QUEUE_POOL_START_TIMEOUT_S, its stuck process killed; the same worker without the
hang starts and runs a job. A real Celery worker (prefork) on a real redis-server, the
subprocess runtime (the sandbox is not the point here)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from testkit.processes import alive
from testkit.stack import Stack
from tests.snippets import OK_CODE

pytestmark = [pytest.mark.redis]

TIMEOUT_S = 4


def test_a_pool_process_stuck_at_start_stops_its_worker_unannounced(tmp_path: Path) -> None:
    from executor.errors import RuntimeUnavailable

    with Stack(
        tmp_path,
        code_runtime="subprocess",
        code_languages="python",
        queue_pool_start_timeout_s=TIMEOUT_S,
        queue_heartbeat_interval_s=0.2,
    ) as stack:
        stuck = stack.start_worker(
            "stuck", 2, app="testkit.hang_app", ping=False, env={"TESTKIT_POOL_HANG_S": "600"}
        )
        announced, answered, pool = [], [], set()
        deadline = time.monotonic() + 60
        while stuck.alive() and time.monotonic() < deadline:
            announced += [i.nodename for i in stack.client.live_workers()["code.run"]]
            answered += stack.client.app.control.ping([stuck.node], timeout=0.2) or []
            pool |= {p for p in stuck.tree() if p != stuck.pid}
        assert not stuck.alive(), f"the worker did not stop:\n{stuck.tail(20)}"
        assert stuck.proc.returncode != 0, stuck.tail(20)
        out = stuck.output()
        assert "did not start within STUDIO_QUEUE_POOL_START_TIMEOUT_S=4 s" in out, out[-3000:]
        assert not announced and not answered, (announced, answered)
        assert pool and not [p for p in pool if alive(p)], "a pool process outlived its worker"
        with pytest.raises(RuntimeUnavailable, match="No worker is serving code.run"):
            stack.client.submit(OK_CODE, "python", {"n": 1})

        # the same worker, its pool processes not stuck: announced, it runs a job
        fine = stack.start_worker("fine", 2, app="testkit.hang_app")
        job = stack.client.submit(OK_CODE, "python", {"n": 1})
        assert stack.client.wait(job, timeout_s=60).status.value == "succeeded"
        assert fine.alive() and "did not start" not in fine.output()
