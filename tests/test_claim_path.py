"""A delivery whose claim takes nothing, on a pool process's real state (its SQLite run store
and a redis-server of the test's own): the claim's own transaction says why (unknown,
cancelled while queued, finished, not ended), and the job path reads the row no more after
it. The outcomes are those a worker logs; ``fair_end``: whether the delivery frees the
user's fair-queue slot (a job still running elsewhere frees nothing)."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from executor.errors import ErrorCode
from executor.models import CodeJob, CodeResult, Status

pytestmark = pytest.mark.redis


def test_a_failed_claim_says_why_in_its_own_transaction_and_nothing_reads_the_row_again(
    redis_server: Any, tmp_path: Path, make_settings: Any
) -> None:
    from worker.job import tasks

    state = tasks.ProcessState(make_settings(redis_url=redis_server.url, code_runtime="docker"))
    store = state.store
    sent: list[str] = []
    event.listen(store._engine, "connect", lambda conn, _: conn.set_trace_callback(sent.append))  # type: ignore[attr-defined]
    store._engine.dispose()  # type: ignore[attr-defined]  # new connections: traced

    def new_job() -> str:
        job = CodeJob(code="def main(s):\n    return 1\n")
        assert store.create(job, code_runtime="docker")
        return job.job_id

    cancelled = new_job()
    store.request_cancel(cancelled)
    finished = new_job()
    store.claim(finished, "w")
    ended = CodeResult.ended(
        finished, "python", Status.FAILED, ErrorCode.CODE_ERROR, "x", runtime="docker"
    )
    assert store.finish(ended, worker="w")
    running = new_job()
    store.claim(running, "w")
    cases = [  # job, redelivered, outcome, fair_end
        ("no-such-job", True, "unknown", True),
        (cancelled, True, "skipped", True),
        (finished, True, "skipped", True),
        (running, False, "skipped", False),  # another copy's first delivery: not ended
    ]
    try:
        for job_id, redelivered, name, fair_end in cases:
            request = types.SimpleNamespace(
                delivery_info={"redelivered": redelivered}, hostname="m@h"
            )
            sent.clear()
            out = tasks._run(state, job_id, "m@h:1", "code.run", request)
            assert (out.name, out.fair_end) == (name, fair_end), (job_id, out)
            statements = [s.split()[0].upper() for s in sent]
            assert statements.count("UPDATE") == 1, sent  # the claim
            assert statements.count("BEGIN") == 1, f"one transaction, not {sent}"
            after = statements[statements.index("UPDATE") + 1 :]
            assert after.count("SELECT") == 1 and after[-1] == "COMMIT", sent
    finally:
        state.close()
