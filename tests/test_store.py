"""The run store, every test against a real SQLite file AND a real PostgreSQL.

PostgreSQL: STUDIO_TEST_POSTGRES_URL (default postgresql+psycopg://postgres@127.0.0.1:5432/test).
Each test gets its own schema (dropped afterwards). Unreachable: skipped, or failed when CI=true.
"""

from __future__ import annotations

import json
import os
import random
import time
import uuid
import warnings
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from executor.errors import ErrorCode
from executor.models import CodeErrorInfo, CodeJob, CodeResult, Status, TraceRow
from executor.store import (
    CANCELLED_BEFORE_START,
    CANCELLED_WHILE_RUNNING,
    JobRecord,
    RunStore,
    SqlRunStore,
    open_store,
)
from testkit.postgres import pg_admin, pg_schema
from testkit.processes import in_processes

MB = 1024 * 1024


# --- fixtures ----------------------------------------------------------------------------


@pytest.fixture(
    params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)],
)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A URL of an empty run store: a SQLite file in a folder that does not exist yet, or
    a fresh PostgreSQL schema (search_path set through libpq options)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'data' / 'nested' / 'studio-code.db'}"
        return
    with pg_schema(request.getfixturevalue("postgres_url"), "test_store") as url:
        yield url


@pytest.fixture
def store(store_url: str) -> Iterator[RunStore]:
    s = open_store(store_url)
    try:
        yield s
    finally:
        s.close()


# --- helpers -----------------------------------------------------------------------------


def _job(**kw: Any) -> CodeJob:
    kw.setdefault("code", "def main(state):\n    return state\n")
    return CodeJob(**kw)


def _result(job_id: str, status: Status = Status.SUCCEEDED, **kw: Any) -> CodeResult:
    kw.setdefault("output", {"ok": True})
    return CodeResult(
        job_id=job_id,
        language="python",
        status=status,
        runtime="docker",
        code_runtime="docker",
        **kw,
    )


def _is_utc(dt: datetime | None) -> bool:
    return dt is not None and dt.tzinfo is not None and dt.utcoffset() == timedelta(0)


def _new(store: RunStore, **kw: Any) -> str:
    job = _job(**kw)
    assert store.create(job, code_runtime="docker") is True
    return job.job_id


def _running(store: RunStore, worker: str = "w1", **kw: Any) -> str:
    job_id = _new(store, **kw)
    assert store.claim(job_id, worker) is not None
    return job_id


# --- create / get ------------------------------------------------------------------------


def test_create_twice_is_one_row(store: RunStore) -> None:
    job = _job(user="ada", kind="test", timeout_s=5, state_json='{"a": 1}')
    before = datetime.now(UTC)
    assert store.create(job, code_runtime="docker") is True
    # Same id again, even with other content: a no-op, not an error, nothing overwritten.
    again = job.model_copy(update={"code": "other"})
    assert store.create(again, code_runtime="subprocess") is False
    assert store.counts_by_status()["queued"] == 1
    assert sum(store.counts_by_status().values()) == 1

    rec = store.get(job.job_id)
    assert isinstance(rec, JobRecord)
    assert rec.status is Status.QUEUED
    assert (rec.kind, rec.user, rec.language) == ("test", "ada", "python")
    assert rec.code == job.code and rec.state_json == '{"a": 1}'
    assert rec.timeout_s == 5 and rec.code_runtime == "docker"
    assert rec.attempts == 0 and rec.worker is None
    assert rec.started_at is None and rec.finished_at is None
    assert _is_utc(rec.queued_at) and before - timedelta(seconds=5) <= rec.queued_at
    assert rec.to_result() is None


def test_get_unknown_and_get_many(store: RunStore) -> None:
    assert store.get("nope") is None
    ids = [_new(store) for _ in range(3)]
    found = store.get_many([*ids, "nope", ids[0]])
    assert set(found) == set(ids)
    assert all(found[i].job_id == i for i in ids)


def test_reopen_existing_store(store_url: str) -> None:
    with open_store(store_url) as first:
        job_id = _new(first)
    with open_store(store_url) as second:  # tables exist: create_all is a no-op
        rec = second.get(job_id)
        assert rec is not None and rec.status is Status.QUEUED


# --- claim -------------------------------------------------------------------------------


def test_claim_queued_then_redelivered(store: RunStore) -> None:
    job_id = _new(store)
    rec = store.claim(job_id, "host-a:1")
    assert rec is not None
    assert rec.status is Status.RUNNING and rec.worker == "host-a:1" and rec.attempts == 1
    assert _is_utc(rec.started_at)
    # Redelivered after a worker died: running -> running, a new worker, attempts + 1.
    again = store.claim(job_id, "host-b:7")
    assert again is not None
    assert again.status is Status.RUNNING and again.worker == "host-b:7" and again.attempts == 2
    assert again.started_at is not None and rec.started_at is not None
    assert again.started_at >= rec.started_at
    assert store.claim("unknown", "w") is None


def test_a_first_delivery_claims_only_a_queued_job(store: RunStore) -> None:
    """claim(again=False), a message's first delivery: a queued job is taken; a running one
    is another copy's (the queued sweep's resend beside a slow holder) and is left as it is;
    a redelivery (again=True) still takes it after a worker's death."""
    job_id = _new(store)
    rec = store.claim(job_id, "host-a:1", again=False)
    assert rec is not None and rec.status is Status.RUNNING and rec.attempts == 1
    before = store.get(job_id)
    assert store.claim(job_id, "host-b:2", again=False) is None
    assert store.get(job_id) == before, "nothing changed"
    again = store.claim(job_id, "host-c:3")
    assert again is not None and again.worker == "host-c:3" and again.attempts == 2


def test_claim_after_cancel_returns_none(store: RunStore) -> None:
    queued = _new(store)
    assert store.request_cancel(queued) is Status.CANCELLED
    before = store.get(queued)
    assert store.claim(queued, "w1") is None
    assert store.get(queued) == before  # nothing changed
    assert before is not None and before.attempts == 0 and before.started_at is None

    cancelling = _running(store)
    assert store.request_cancel(cancelling) is Status.CANCELLING
    before = store.get(cancelling)
    assert store.claim(cancelling, "w2") is None
    assert store.get(cancelling) == before


def test_claim_finished_returns_none(store: RunStore) -> None:
    job_id = _running(store)
    assert store.finish(_result(job_id), worker="w1")
    before = store.get(job_id)
    assert store.claim(job_id, "w2") is None
    assert store.get(job_id) == before


@pytest.mark.parametrize("use_lane", [True, False], ids=["lane", "sqlalchemy"])
def test_a_claim_that_takes_nothing_says_why_in_its_own_transaction(
    store: RunStore, use_lane: bool
) -> None:
    """try_claim answers claimed, or why not (the row's status as the claim found it, and
    whether it had started; no status: unknown), so the worker reads the row no more after
    a failed claim (worker.job.tasks._not_claimed). Through the DBAPI lane and through
    SQLAlchemy's statements."""
    if not use_lane:
        store._lane = None  # type: ignore[attr-defined]
    queued = _new(store)
    assert store.request_cancel(queued) is Status.CANCELLED
    cancelling = _running(store)
    assert store.request_cancel(cancelling) is Status.CANCELLING
    finished = _running(store)
    assert store.finish(_result(finished), worker="w1")
    running = _running(store)

    taken = store.try_claim(_new(store), "w2")
    assert taken.record is not None and taken.record.status is Status.RUNNING, taken
    unknown = store.try_claim("unknown", "w2")
    assert (unknown.record, unknown.status, unknown.unknown, unknown.open) == (
        None,
        None,
        True,
        False,
    )
    c = store.try_claim(queued, "w2")
    assert (c.record, c.status, c.started, c.cancelled_queued, c.open) == (
        None,
        Status.CANCELLED,
        False,
        True,
        False,
    )
    c = store.try_claim(cancelling, "w2")
    assert (c.status, c.started, c.cancelled_queued, c.open) == (
        Status.CANCELLING,
        True,
        False,
        True,
    )
    c = store.try_claim(finished, "w2")
    assert (c.record, c.status, c.started, c.open) == (None, Status.SUCCEEDED, True, False)
    c = store.try_claim(running, "w2", again=False)  # another copy's first delivery
    assert (c.record, c.status, c.started, c.open, c.unknown) == (
        None,
        Status.RUNNING,
        True,
        True,
        False,
    )
    assert store.get(running) is not None and store.get(running).worker == "w1"  # type: ignore[union-attr]


# --- request_cancel ----------------------------------------------------------------------


def test_request_cancel_queued(store: RunStore) -> None:
    job_id = _new(store)
    assert store.is_cancel_requested(job_id) is False
    assert store.request_cancel(job_id) is Status.CANCELLED
    rec = store.get(job_id)
    assert rec is not None
    assert rec.status is Status.CANCELLED
    assert rec.error == CANCELLED_BEFORE_START
    assert rec.error.code is ErrorCode.CODE_CANCELLED
    assert rec.error.message == "Cancelled before it started."
    assert _is_utc(rec.finished_at) and rec.started_at is None
    assert store.is_cancel_requested(job_id) is True
    # Asking again changes nothing.
    assert store.request_cancel(job_id) is Status.CANCELLED
    assert store.get(job_id) == rec


def test_request_cancel_running(store: RunStore) -> None:
    job_id = _running(store)
    assert store.request_cancel(job_id) is Status.CANCELLING
    rec = store.get(job_id)
    assert rec is not None
    assert rec.status is Status.CANCELLING and rec.finished_at is None and rec.error is None
    assert store.is_cancel_requested(job_id) is True
    assert store.request_cancel(job_id) is Status.CANCELLING


def test_request_cancel_finished_is_unchanged(store: RunStore) -> None:
    job_id = _running(store)
    assert store.finish(_result(job_id, output=[1, 2]), worker="w1")
    before = store.get(job_id)
    assert store.request_cancel(job_id) is Status.SUCCEEDED
    assert store.get(job_id) == before
    assert store.is_cancel_requested(job_id) is False


def test_request_cancel_unknown(store: RunStore) -> None:
    assert store.request_cancel("nope") is None
    assert store.is_cancel_requested("nope") is False


# --- finish ------------------------------------------------------------------------------


def test_finish_once_then_duplicate_is_refused(store: RunStore) -> None:
    job_id = _running(store, worker="w1", timeout_s=10)
    trace = [TraceRow(step="start", runtime="docker", duration_ms=12.5, detail="image x")]
    first = _result(
        job_id,
        output={"n": 1, "nested": [None, "é", 1.5]},
        logs="hello\n",
        logs_truncated=True,
        duration_ms=42.0,
        exit_code=0,
        warnings=["slow start"],
        trace=trace,
    )
    assert store.finish(first, worker="w1") is True
    rec = store.get(job_id)
    assert rec is not None
    assert rec.status is Status.SUCCEEDED
    assert rec.output == {"n": 1, "nested": [None, "é", 1.5]}
    assert rec.error is None
    assert (rec.logs, rec.logs_truncated) == ("hello\n", True)
    assert rec.warnings == ["slow start"] and rec.trace == trace
    assert rec.trace[0].runtime == "docker"
    assert (rec.exit_code, rec.duration_ms, rec.runtime) == (0, 42.0, "docker")
    assert rec.worker == "w1" and _is_utc(rec.finished_at)
    assert rec.to_result() == first

    late = _result(
        job_id,
        Status.FAILED,
        output=None,
        error=CodeErrorInfo(code=ErrorCode.CODE_ERROR, message="boom"),
        logs="other",
    )
    assert store.finish(late, worker="w2") is False
    assert store.get(job_id) == rec


def test_finish_unknown_and_unfinished_status(store: RunStore) -> None:
    assert store.finish(_result("nope"), worker="w") is False
    job_id = _running(store)
    with pytest.raises(ValueError):
        store.finish(_result(job_id, Status.RUNNING), worker="w")
    rec = store.get(job_id)
    assert rec is not None and rec.status is Status.RUNNING


def test_finish_queued_job(store: RunStore) -> None:
    """A worker may refuse a job before running it (e.g. invalid code)."""
    job_id = _new(store)
    err = CodeErrorInfo(code=ErrorCode.CODE_INVALID, message="No main function.")
    assert store.finish(_result(job_id, Status.INVALID, output=None, error=err), worker="w")
    rec = store.get(job_id)
    assert rec is not None and rec.status is Status.INVALID and rec.error == err


def test_finish_while_cancelling_ends_cancelled(store: RunStore) -> None:
    job_id = _running(store)
    assert store.request_cancel(job_id) is Status.CANCELLING
    res = _result(job_id, output={"x": 1}, logs="partial\n", duration_ms=77.0, exit_code=0)
    assert store.finish(res, worker="w1") is True
    rec = store.get(job_id)
    assert rec is not None
    assert rec.status is Status.CANCELLED
    assert rec.error == CANCELLED_WHILE_RUNNING
    assert rec.error.message == "Cancelled while running."
    assert rec.output is None
    assert rec.logs == "partial\n" and rec.duration_ms == 77.0
    assert _is_utc(rec.finished_at)
    assert store.finish(res, worker="w1") is False


def test_awkward_text_is_stored(store: RunStore, store_url: str) -> None:
    """NUL characters and lone surrogates in printed output do not break the write."""
    job_id = _running(store)
    res = _result(job_id, logs="a\x00b\ud800c", output={"s": "x\x00y"})
    assert store.finish(res, worker="w1") is True
    rec = store.get(job_id)
    assert rec is not None
    nul = "\x00" if store_url.startswith("sqlite") else "\ufffd"
    assert rec.logs == f"a{nul}b?c"
    assert rec.output == {"s": "x\x00y"}  # JSON text escapes the NUL


def test_an_output_no_route_could_render_is_stored_as_output_invalid(store: RunStore) -> None:
    """A lone surrogate in an output (a CodeResult made outside the executor, which refuses
    it first) is never stored as output: GET would answer 500 for good."""
    job_id = _running(store)
    assert store.finish(_result(job_id, output={"s": "x\udfff"}), worker="w1") is True
    rec = store.get(job_id)
    assert rec is not None and rec.status is Status.FAILED and rec.output is None
    assert rec.error is not None and rec.error.code is ErrorCode.CODE_OUTPUT_INVALID
    assert "lone surrogate" in rec.error.message


# --- big state ---------------------------------------------------------------------------


def test_ten_megabyte_state_round_trips(store: RunStore) -> None:
    rows = [{"i": i, "name": f"ünïcødé-{i}", "v": i * 0.5} for i in range(100_000)]
    state = json.dumps({"rows": rows, "pad": "z" * (8 * MB)}, ensure_ascii=False)
    assert len(state.encode()) > 10 * MB
    job_id = _new(store, state_json=state)
    rec = store.get(job_id)
    assert rec is not None and rec.state_json == state
    claimed = store.claim(job_id, "w1")
    assert claimed is not None and claimed.state_json == state


def test_code_and_state_live_outside_the_row_the_queue_updates(store: RunStore) -> None:
    """claim and finish update code_jobs; a job's code and state are in code_job_inputs, so
    neither update copies them (SQLite rewrites a whole row per UPDATE), and the reads that
    do not need them (status, wait, views: inputs=False) do not load them."""
    assert isinstance(store, SqlRunStore)
    state = json.dumps({"pad": "s" * MB})
    job_id = _new(store, state_json=state)

    def raw() -> tuple[Any, ...]:
        with store.engine.connect() as conn:
            row = conn.execute(
                text(
                    "SELECT j.code, j.state_json, i.code, i.state_json FROM code_jobs j "
                    "LEFT JOIN code_job_inputs i ON i.job_id = j.job_id WHERE j.job_id = :j"
                ),
                {"j": job_id},
            ).one()
        return tuple(row)

    assert raw() == ("", "{}", _job().code, state)
    light = store.get(job_id, inputs=False)
    assert light is not None and light.code == "" and light.state_json == "{}"
    assert light.status is Status.QUEUED
    claimed = store.claim(job_id, "w1")
    assert claimed is not None and claimed.state_json == state and claimed.code == _job().code
    assert claimed.status is Status.RUNNING and claimed.attempts == 1 and claimed.worker == "w1"
    assert store.finish(_result(job_id), worker="w1") is True
    assert raw() == ("", "{}", _job().code, state)
    full = store.get(job_id)
    assert full is not None and full.state_json == state and full.output == {"ok": True}
    many = store.get_many([job_id], inputs=False)
    assert many[job_id].state_json == "{}" and many[job_id].status is Status.SUCCEEDED


def test_a_row_made_before_the_inputs_table_is_claimed_with_its_own_code_and_state(
    store_url: str,
) -> None:
    """A store made by an older release holds code and state in code_jobs, with no row in
    code_job_inputs: its queued jobs still run with them (the migration at open moves them;
    tests/test_store_migrations.py has the stores each older release made)."""
    with open_store(store_url) as made:
        assert isinstance(made, SqlRunStore)
        job_id = _new(made)
        code = "def main(state):\n    return state['legacy']\n"
        with made.engine.begin() as conn:
            conn.execute(text("DELETE FROM code_job_inputs WHERE job_id = :j"), {"j": job_id})
            conn.execute(
                text("UPDATE code_jobs SET code = :c, state_json = :s WHERE job_id = :j"),
                {"c": code, "s": '{"legacy": 1}', "j": job_id},
            )
            conn.execute(text("DROP TABLE code_alembic_version"))  # made before migrations
    with open_store(store_url) as store:
        rec = store.get(job_id)
        assert rec is not None and rec.code == code and rec.state_json == '{"legacy": 1}'
        claimed = store.claim(job_id, "w1")
        assert claimed is not None and claimed.code == code
        assert claimed.state_json == '{"legacy": 1}' and claimed.to_job().code == code


def test_finish_with_outcome_says_what_was_stored(store: RunStore) -> None:
    """What a worker reports to Celery without reading the row back: the status the job
    really ended with (a cancel while running wins; a refused output makes it failed)."""
    plain = _running(store)
    ended = store.finish_with_outcome(_result(plain), worker="w1")
    assert ended is not None and ended.status is Status.SUCCEEDED and ended.error is None
    assert store.finish_with_outcome(_result(plain), worker="w1") is None
    cancelling = _running(store)
    assert store.request_cancel(cancelling) is Status.CANCELLING
    ended = store.finish_with_outcome(_result(cancelling), worker="w1")
    assert ended is not None and ended.status is Status.CANCELLED
    assert ended.error == CANCELLED_WHILE_RUNNING
    refused = _running(store)
    ended = store.finish_with_outcome(_result(refused, output={"s": "x\udfff"}), worker="w1")
    assert ended is not None and ended.status is Status.FAILED
    assert ended.error is not None and ended.error.code is ErrorCode.CODE_OUTPUT_INVALID
    assert store.finish_with_outcome(_result("nope"), worker="w1") is None


def test_retention_removes_code_and_state_with_the_run(store: RunStore) -> None:
    assert isinstance(store, SqlRunStore)
    cleared, deleted, recent = (_running(store, state_json='{"n": 1}') for _ in range(3))
    for job_id in (cleared, deleted, recent):
        assert store.finish(_result(job_id), worker="w1")
    later = datetime.now(UTC) + timedelta(seconds=1)
    with store.engine.begin() as conn:  # only `deleted` is old enough to go entirely
        conn.execute(
            text("UPDATE code_jobs SET finished_at = :t WHERE job_id = :j"),
            {"t": datetime(2000, 1, 1), "j": deleted},
        )
        conn.execute(
            text("UPDATE code_jobs SET finished_at = :t WHERE job_id = :j"),
            {"t": datetime(2001, 1, 1), "j": cleared},
        )
    report = store.prune(runs_before=datetime(2000, 6, 1, tzinfo=UTC), payloads_before=later)
    assert report.deleted == 1
    with store.engine.connect() as conn:
        left = set(conn.execute(text("SELECT job_id FROM code_job_inputs")).scalars())
    assert left == set()  # recent: its payload was cleared too (payloads_before=later)
    assert store.get(deleted) is None
    rec = store.get(cleared)
    assert rec is not None and rec.code == "" and rec.state_json == "{}"
    assert rec.pruned_at is not None
    fresh = _running(store, state_json='{"n": 2}')
    assert store.finish(_result(fresh), worker="w1")
    store.prune(runs_before=datetime(2000, 6, 1, tzinfo=UTC), payloads_before=None)
    rec = store.get(fresh)
    assert rec is not None and rec.state_json == '{"n": 2}'  # not old enough: untouched


# --- fail_stuck --------------------------------------------------------------------------


def test_fail_stuck_leaves_jobs_whose_message_is_still_queued(store: RunStore) -> None:
    """A job whose worker died mid-run, with its message back in the broker (kept), is not
    stuck: it comes round again and ends with its real outcome, not "worker stopped"."""
    requeued = _running(store, timeout_s=2)
    lost = _running(store, timeout_s=2)
    assert store.fail_stuck(-10, "gone", keep={requeued, "other"}) == [lost]
    assert store.get(requeued).status is Status.RUNNING  # type: ignore[union-attr]
    assert store.fail_stuck(-10, "gone", keep={requeued}) == []  # nothing else to end
    assert store.fail_stuck(-10, "gone") == [requeued]  # once its message is gone


def test_fail_stuck(store: RunStore) -> None:
    short = _running(store, timeout_s=2)  # deadline: started + 2 s
    default = _running(store)  # no timeout: default_timeout_s applies
    cancelling = _running(store, timeout_s=2)
    assert store.request_cancel(cancelling) is Status.CANCELLING
    queued = _new(store, timeout_s=1)
    done = _running(store, timeout_s=1)
    assert store.finish(_result(done), worker="w1")
    done_before = store.get(done)

    assert store.fail_stuck(60, "gone") == []  # nobody is 60 s past a deadline
    # A negative margin stands for time having passed: started + timeout - 10 s < now
    # for the 2 s jobs, but not for the default (30 s) one.
    reason = "The worker running this job stopped; run it again."
    changed = store.fail_stuck(-10, reason, default_timeout_s=30)
    assert sorted(changed) == sorted([short, cancelling])

    rec = store.get(short)
    assert rec is not None and rec.status is Status.FAILED
    assert rec.error == CodeErrorInfo(code=ErrorCode.RUNTIME_UNAVAILABLE, message=reason)
    assert _is_utc(rec.finished_at)
    rec = store.get(cancelling)
    assert rec is not None and rec.status is Status.CANCELLED
    assert rec.error is not None and rec.error.code is ErrorCode.RUNTIME_UNAVAILABLE

    assert store.get(default).status is Status.RUNNING  # type: ignore[union-attr]
    assert store.get(queued).status is Status.QUEUED  # type: ignore[union-attr]
    assert store.get(done) == done_before

    # The default timeout counts too, and nothing is changed twice.
    assert store.fail_stuck(-100, reason, default_timeout_s=30) == [default]
    assert store.fail_stuck(-100, reason) == []
    # The worker was not dead after all: its late result is refused.
    assert store.finish(_result(short), worker="w1") is False
    assert store.get(short).status is Status.FAILED  # type: ignore[union-attr]


def test_redelivery_extends_the_deadline(store: RunStore) -> None:
    job_id = _running(store, timeout_s=5)
    assert store.fail_stuck(-2, "gone") == []
    assert store.claim(job_id, "w2") is not None  # a new started_at
    assert store.fail_stuck(-2, "gone") == []
    assert store.fail_stuck(-6, "gone") == [job_id]


# --- audit & counts ----------------------------------------------------------------------


def test_audit_write_and_list(store: RunStore) -> None:
    assert store.list_audit() == []
    store.audit("system.code_runtime_subprocess", {"runtime": "subprocess", "host": "a"})
    store.audit("job.cancel", {"job_id": "j1"}, actor="user:ada")
    store.audit("system.code_runtime_subprocess", {"runtime": "subprocess", "host": "b"})

    entries = store.list_audit()
    assert [e.event for e in entries] == [
        "system.code_runtime_subprocess",
        "job.cancel",
        "system.code_runtime_subprocess",
    ]
    assert entries[0].details == {"runtime": "subprocess", "host": "b"}  # newest first
    assert entries[0].id > entries[1].id > entries[2].id
    assert entries[1].actor == "user:ada" and entries[0].actor == "system"
    assert all(_is_utc(e.at) for e in entries)

    sub = store.list_audit("system.code_runtime_subprocess")
    assert [e.details["host"] for e in sub] == ["b", "a"]
    assert [e.details["host"] for e in store.list_audit("system.code_runtime_subprocess", 1)] == [
        "b"
    ]
    assert store.list_audit("nothing") == []


def test_counts_by_status(store: RunStore) -> None:
    assert store.counts_by_status() == {s.value: 0 for s in Status}
    _new(store)
    _new(store)
    running = _running(store)
    cancelled = _new(store)
    store.request_cancel(cancelled)
    done = _running(store)
    store.finish(_result(done, Status.TIMED_OUT, output=None), worker="w1")
    counts = store.counts_by_status()
    assert counts["queued"] == 2 and counts["running"] == 1
    assert counts["cancelled"] == 1 and counts["timed_out"] == 1
    assert sum(counts.values()) == 5
    assert running


# --- the SQLite file -----------------------------------------------------------------------


def test_sqlite_file_uses_wal_and_busy_timeout(tmp_path: Path) -> None:
    db = tmp_path / "a" / "b" / "studio-code.db"
    with SqlRunStore(f"sqlite:///{db}") as s:
        assert db.exists()
        with s.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30_000


def test_a_store_opened_while_another_process_holds_the_write_lock_reads(
    tmp_path: Path,
) -> None:
    """Another process holds the file's write lock (a backup, an admin shell's BEGIN
    EXCLUSIVE): a store opened now (a worker's readiness probe, a pool process's fresh
    connection) reads at once; its connection's set-up takes no write lock (WAL readers
    never wait for a writer). A new file still gets incremental auto-vacuum."""
    import sqlite3
    import threading

    db = tmp_path / "studio-code.db"
    with SqlRunStore(f"sqlite:///{db}") as s:
        job = _new(s)
        with s.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA auto_vacuum").scalar() == 2  # incremental
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    got: dict[str, Any] = {}

    def read() -> None:
        try:
            with SqlRunStore(f"sqlite:///{db}") as other:
                got["rec"] = other.get(job)
        except Exception as e:  # noqa: BLE001 - reported below
            got["error"] = e

    try:
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(15)  # a hang guard: the old set-up waited out busy_timeout (30 s)
        assert not reader.is_alive(), "opening the store waited for the write lock"
        assert holder.in_transaction
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert "error" not in got, got
    assert got["rec"].job_id == job and got["rec"].status == "queued"


def _wal_generation(db: Path) -> bytes:
    """The WAL header's checkpoint sequence and salts: they change when a write starts the
    WAL over after a checkpoint copied it all (and only then)."""
    with open(f"{db}-wal", "rb") as f:
        return f.read(32)[12:24]


def test_the_wal_is_started_over_by_the_checkpointer_not_by_a_job(tmp_path: Path) -> None:
    """The first write after a complete checkpoint starts the WAL over and, with
    synchronous=NORMAL, syncs its header first. The store's checkpointer takes that turn
    right after its checkpoint, so the next job's write appends to a WAL already started
    over: its header is the same before and after the job's write (no sync on its path).
    Nothing a reader sees changes (user_version stays 0; the rows are all there)."""
    db = tmp_path / "studio-code.db"
    with SqlRunStore(f"sqlite:///{db}") as s:
        first = _new(s)
        written = _wal_generation(db)
        deadline = time.monotonic() + 10
        while _wal_generation(db) == written:  # the checkpointer's pass, 0.5 s after it
            assert time.monotonic() < deadline, "the checkpointer never started the WAL over"
            time.sleep(0.05)
        started_over = _wal_generation(db)
        second = _new(s)  # a job's write right after
        assert _wal_generation(db) == started_over
        with s.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA user_version").scalar() == 0
        assert s.get(first) is not None and s.get(second) is not None


def test_postgres_url_without_driver_uses_psycopg(postgres_url: str) -> None:
    plain = pg_admin(postgres_url)  # postgresql://: no driver named
    s = SqlRunStore(plain, create_tables=False)
    try:
        assert s.engine.dialect.driver == "psycopg"
        with s.engine.connect() as conn:
            assert conn.execute(text("SELECT 1")).scalar() == 1
    finally:
        s.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_does_not_reuse_parent_connections(store: RunStore) -> None:
    """Celery's prefork pool forks after the store may have been opened."""
    job_id = _new(store)
    assert store.get(job_id) is not None  # the pool now holds an open connection
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            rec = store.claim(job_id, "child")
            code = 0 if rec is not None and rec.worker == "child" else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # The parent's pooled connection still works (the child neither used nor closed it).
    rec = store.get(job_id)
    assert rec is not None and rec.status is Status.RUNNING and rec.worker == "child"
    assert store.finish(_result(job_id), worker="child")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("what", ["write", "checkpoint"])
def test_a_fork_during_a_write_or_a_checkpoint_leaves_the_child_a_working_store(
    tmp_path: Path, what: str
) -> None:
    """SQLite keeps its locks in process memory: a child forked while another thread of the
    parent held a write transaction (or ran the WAL checkpoint) inherited that lock, and
    every store it opened failed "database is locked" for its whole life (seen in a worker
    whose prefork pool started beside the main process's first writes). The fork now waits
    for the call in flight; the child's own store works, and the parent's call ended first."""
    import threading
    import time

    from executor.store import sqlite

    sqlite_url = f"sqlite:///{tmp_path / 'fork.db'}"
    store = open_store(sqlite_url)
    job_id = _new(store)
    inside, ended = threading.Event(), threading.Event()

    def hold() -> None:
        if what == "write":
            ctx: Any = store._write()  # type: ignore[attr-defined]
        else:  # the checkpoint thread's hold (the gate) around a raw connection's PRAGMA
            ctx = sqlite.FORK_GATE.held()
        with ctx:
            if what == "checkpoint":
                raw = store._engine.raw_connection()  # type: ignore[attr-defined]
                raw.cursor().execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            inside.set()
            time.sleep(0.5)
            if what == "checkpoint":
                raw.close()
        ended.set()

    holder = threading.Thread(target=hold)
    holder.start()
    assert inside.wait(10)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            sqlite.BUSY_TIMEOUT_MS = 3000  # a poisoned child fails in 3 s, not 30
            own = open_store(sqlite_url)
            rec = own.claim(job_id, "child")
            code = 0 if rec is not None and rec.worker == "child" else 2
        finally:
            os._exit(code)
    ended_before_fork = ended.is_set()  # read at once in the parent: the fork waited
    _, status = os.waitpid(pid, 0)
    holder.join(10)
    assert ended_before_fork, "the fork did not wait for the call in flight"
    assert os.waitstatus_to_exitcode(status) == 0, "the child's store was locked"
    rec = store.get(job_id)
    assert rec is not None and rec.worker == "child"
    store.close()


# --- many processes at once ----------------------------------------------------------------

N_PROCS = 8
N_JOBS = 50


def _race(url: str, job_ids: list[str], worker: str, barrier: Any, out: Any) -> None:
    """One worker process: create, claim and finish every job, in its own order."""
    warnings.simplefilter("error")
    warnings.simplefilter("ignore", ResourceWarning)
    store = None
    try:
        store = open_store(url)
        ids = list(job_ids)
        random.Random(worker).shuffle(ids)
        barrier.wait(timeout=120)
        created = [i for i in ids if store.create(_job(job_id=i), code_runtime="docker")]
        claimed = 0
        won = []
        for job_id in ids:
            if store.claim(job_id, worker) is not None:
                claimed += 1
            res = _result(job_id, output={"by": worker}, logs=f"from {worker}")
            if store.finish(res, worker=worker):
                won.append(job_id)
        out.put((worker, created, won, claimed, None))
    except BaseException as e:  # report, the parent fails the test
        out.put((worker, [], [], 0, f"{type(e).__name__}: {e}"))
    finally:
        if store is not None:
            store.close()


@pytest.mark.slow
def test_concurrent_processes_write_each_job_once(store_url: str) -> None:
    with open_store(store_url) as store:  # tables exist before the race starts
        job_ids = [f"race-{uuid.uuid4().hex}" for _ in range(N_JOBS)]
        reports = in_processes(_race, [(store_url, job_ids, f"w{n}") for n in range(N_PROCS)])

        errors = [(w, err) for w, _, _, _, err in reports if err]
        assert errors == []

        created = [j for _, c, _, _, _ in reports for j in c]
        assert sorted(created) == sorted(job_ids)  # each create won exactly once
        winners = {j: w for w, _, won, _, _ in reports for j in won}
        total_true = sum(len(won) for _, _, won, _, _ in reports)
        assert total_true == N_JOBS  # each job written exactly once
        assert set(winners) == set(job_ids)

        records = store.get_many(job_ids)
        assert len(records) == N_JOBS
        for job_id, rec in records.items():
            assert rec.status is Status.SUCCEEDED
            assert rec.worker == winners[job_id]
            assert rec.output == {"by": winners[job_id]}
            assert rec.logs == f"from {winners[job_id]}"
            assert rec.attempts >= 1
        assert store.counts_by_status()["succeeded"] == N_JOBS


# --- the job path's DBAPI lane (executor.store.fast) -------------------------------------


def _stored_row(store: SqlRunStore, job_id: str) -> dict[str, Any]:
    """The job's row as the database holds it (no type conversion): what a release that
    reads it with SQLAlchemy, or an operator with sqlite3/psql, sees."""
    with store.engine.connect() as conn:
        row = conn.exec_driver_sql(
            "SELECT * FROM code_jobs j JOIN code_job_inputs i USING (job_id) WHERE job_id = "
            + ("?" if store.dialect == "sqlite" else "%s"),
            (job_id,),
        ).one()
    return dict(row._mapping)


def _types(row: dict[str, Any]) -> dict[str, str]:
    return {k: type(v).__name__ for k, v in row.items()}


def test_the_dbapi_lane_writes_and_reads_what_sqlalchemy_does(store: RunStore) -> None:
    """create, claim and finish take a lane of plain DBAPI statements (SQLite and
    PostgreSQL). Two twin jobs, one through the lane, one through SQLAlchemy's statements
    (the lane switched off): the stored rows hold the same values of the same types, and
    every record the lane returns equals what SQLAlchemy reads back from its row. Awkward
    values included: NUL and non-ASCII text, a user named like a reserved word, limits,
    a cancel while running."""
    assert isinstance(store, SqlRunStore)
    lane = store._lane
    assert lane is not None, "the lane is off: this database should take it"

    def one_job(use_lane: bool, cancel: bool) -> tuple[str, list[JobRecord]]:
        store._lane = lane if use_lane else None
        try:
            job = _job(
                code="def main(state):\n    return 'ü\x00'\n",
                state_json='{"a": "\\u0000 ü"}',
                timeout_s=2.5,
                kind="test",
                user='select "user"',
                memory_bytes=256 * MB,
                cpus=0.5,
            )
            assert store.create(job, code_runtime="docker") is True
            assert store.create(job, code_runtime="docker") is False  # once
            claimed = store.claim(job.job_id, "w1:7")
            assert claimed is not None
            if cancel:
                assert store.request_cancel(job.job_id) is Status.CANCELLING
            res = _result(
                job.job_id,
                output={"s": "x\x00y", "n": 1.5},
                logs="out\x00 ü\n",
                logs_truncated=True,
                exit_code=0,
                duration_ms=12.25,
                warnings=["one sentence"],
                trace=[TraceRow(step="code.run", runtime="docker", duration_ms=3.5)],
            )
            ended = store.finish_with_outcome(res, worker="w1:7")
            assert ended is not None and ended.record is not None
            assert store.finish_with_outcome(res, worker="w1:7") is None  # once
            return job.job_id, [claimed, ended.record]
        finally:
            store._lane = lane

    for cancel in (False, True):
        fast_id, fast = one_job(True, cancel)
        slow_id, slow = one_job(False, cancel)
        # what the lane returned is what SQLAlchemy reads from the same row
        reread = store.get(fast_id)
        assert reread is not None
        assert fast[1] == reread.model_copy(update={"code": "", "state_json": "{}"})
        assert fast[0].code == reread.code and fast[0].state_json == reread.state_json
        # and the twins agree, but for their ids and times
        times = {"job_id", "queued_at", "started_at", "finished_at"}
        for a, b in zip(fast, slow, strict=True):
            assert a.model_dump(exclude=times) == b.model_dump(exclude=times)
            assert a.started_at is not None and a.started_at.tzinfo is not None
        assert fast[1].status is (Status.CANCELLED if cancel else Status.SUCCEEDED)
        # the rows as stored: the same values, and the same types (SQLite keeps times as
        # text in SQLAlchemy's format, booleans as integers)
        raw_fast, raw_slow = _stored_row(store, fast_id), _stored_row(store, slow_id)
        assert _types(raw_fast) == _types(raw_slow)
        skip = times | {"started_ts"}
        assert {k: v for k, v in raw_fast.items() if k not in skip} == {
            k: v for k, v in raw_slow.items() if k not in skip
        }
        if store.dialect == "sqlite":
            assert len(raw_fast["queued_at"]) == len(raw_slow["queued_at"]) == 26
    # a job that is not there, or not open
    assert store.claim("nope", "w1") is None
    assert store.finish_with_outcome(_result("nope"), worker="w1") is None


def test_the_dbapi_lane_reads_a_bad_value_as_sqlalchemy_does(store: RunStore) -> None:
    """A row with values no record can hold (an unknown language and warnings that are not
    JSON, written by hand) is claimed through the lane all the same: the record names the
    problem (``problems``) and the worker ends it failed, as with SQLAlchemy's reader."""
    assert isinstance(store, SqlRunStore) and store._lane is not None
    job_id = _new(store)
    with store.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE code_jobs SET language = 'cobol', warnings = 'not json' WHERE job_id = :i"
            ),
            {"i": job_id},
        )
    rec = store.claim(job_id, "w1")
    assert rec is not None and rec.status is Status.RUNNING
    assert any(p.startswith("language=") for p in rec.problems), rec.problems
    assert any(p.startswith("warnings=") for p in rec.problems), rec.problems
    again = store.get(job_id)  # SQLAlchemy's reader
    assert again is not None and again.problems == rec.problems


def test_a_failed_lane_statement_leaves_the_store_usable(store: RunStore) -> None:
    """A statement of the lane that the database refuses rolls its whole transaction back:
    an inputs row refused leaves no job row either (both rows or neither, as before), a
    statement refused outright leaves the next calls working."""
    assert isinstance(store, SqlRunStore) and store._lane is not None
    bad = _job()
    values = {
        "job_id": bad.job_id,
        "status": "queued",
        "language": "python",
        "queued_at": datetime.now(UTC),
        "attempts": 0,
    }
    # code_job_inputs.code is NOT NULL: the second INSERT fails, the first is undone
    refused = {"job_id": bad.job_id, "code": None, "state_json": "{}"}
    assert store._lane.create(values, refused) is False
    assert store.get(bad.job_id) is None
    # a value no INTEGER column takes: refused by the driver (SQLite) or the server (PG)
    with pytest.raises(Exception, match="too large|out of range"):  # noqa: PT011 - the driver's
        store._lane.create({**values, "attempts": 2**70}, {**refused, "code": ""})
    assert store.get(bad.job_id) is None
    job_id = _new(store)
    assert store.claim(job_id, "w1") is not None
    assert store.finish(_result(job_id), worker="w1") is True
