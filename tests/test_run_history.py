"""Run history and retention in the run store, on a real SQLite file AND a real PostgreSQL:
filters, keyset pages, the index the list uses, an older database upgraded at open, and
retention over 100,000 synthetic rows in bounded batches."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert, inspect, text

from executor.models import CodeJob, CodeResult, Status
from executor.store import RunFilter, SqlRunStore, decode_cursor, encode_cursor, open_store
from executor.store.schema import job_inputs, jobs


def _rows(n: int, *, start: datetime, step_s: float = 1.0, **fixed: Any) -> list[dict]:
    """``n`` synthetic finished runs, queued ``step_s`` apart from ``start``."""
    out = []
    for i in range(n):
        at = start + timedelta(seconds=i * step_s)
        row = {
            "job_id": uuid.uuid4().hex,
            "status": "succeeded",
            "kind": "run",
            "user": f"user{i % 3}",
            "language": "python" if i % 2 else "typescript",
            "code": "def main(state):\n    return state\n" * 4,
            "state_json": '{"n": 1}',
            "timeout_s": 30.0,
            "code_runtime": "docker",
            "runtime": "docker",
            "output": '{"n": 1}',
            "error": None,
            "logs": "printed\n" * 8,
            "logs_truncated": False,
            "warnings": "[]",
            "trace": "[]",
            "exit_code": 0,
            "duration_ms": 12.5,
            "queued_at": at,
            "started_at": at,
            "finished_at": at + timedelta(seconds=1),
            "started_ts": at.timestamp(),
            "worker": "w@host:1",
            "attempts": 1,
        }
        row.update(fixed)
        out.append(row)
    return out


def _insert(store: SqlRunStore, rows: list[dict], chunk: int = 20_000) -> None:
    """``rows`` as ``create`` lays them out: the code and state in code_job_inputs."""
    inputs = [{k: r[k] for k in ("job_id", "code", "state_json")} for r in rows]
    rows = [{**r, "code": "", "state_json": "{}"} for r in rows]
    with store.engine.begin() as conn:  # executemany: one statement, many parameter sets
        for i in range(0, len(rows), chunk):
            conn.execute(insert(jobs), rows[i : i + chunk])
            conn.execute(insert(job_inputs), inputs[i : i + chunk])


def _store(url: str) -> SqlRunStore:
    store = open_store(url)
    assert isinstance(store, SqlRunStore)
    return store


def test_list_filters_and_pages_newest_first(store_url: str) -> None:
    now = datetime.now(UTC).replace(microsecond=0)
    with _store(store_url) as store:
        # 45 rows, several sharing one queued_at: the cursor must break ties by job_id
        rows = _rows(30, start=now - timedelta(hours=1), step_s=60)
        rows += _rows(15, start=now - timedelta(minutes=10), step_s=0)
        rows[3]["status"] = "failed"
        rows[4]["code_runtime"] = "subprocess"
        _insert(store, rows)
        # one through the real API as well
        job = CodeJob(code="x", user="user0")
        assert store.create(job, code_runtime="docker")

        seen: list[str] = []
        before = None
        while True:
            page = store.list_runs(RunFilter(), limit=7, before=before)
            seen += [r.job_id for r in page]
            if len(page) < 7:
                break
            before = decode_cursor(encode_cursor(page[-1]))
        assert len(seen) == len(set(seen)) == 46
        expected = sorted(
            rows + [{"job_id": job.job_id, "queued_at": store.get(job.job_id).queued_at}],  # type: ignore[union-attr]
            key=lambda r: (r["queued_at"], r["job_id"]),
            reverse=True,
        )
        assert seen == [r["job_id"] for r in expected]

        mine = store.list_runs(RunFilter(user="user1"), limit=100)
        assert mine and {r.user for r in mine} == {"user1"}
        assert len(mine) == sum(1 for r in rows if r["user"] == "user1")
        failed = store.list_runs(RunFilter(status=(Status.FAILED,)), limit=100)
        assert [r.job_id for r in failed] == [rows[3]["job_id"]]
        sub = store.list_runs(RunFilter(code_runtime="subprocess"), limit=100)
        assert [r.job_id for r in sub] == [rows[4]["job_id"]]
        ts = store.list_runs(RunFilter(language="typescript", user="user0"), limit=100)
        assert {(r.language, r.user) for r in ts} == {("typescript", "user0")}
        window = store.list_runs(
            RunFilter(
                since=now - timedelta(minutes=59, seconds=30),
                until=now - timedelta(minutes=57, seconds=30),
            )
        )
        assert [r.job_id for r in window] == [rows[2]["job_id"], rows[1]["job_id"]]
        queued = store.list_runs(RunFilter(status=(Status.QUEUED,)))
        assert [r.job_id for r in queued] == [job.job_id]
        # a summary carries no payload
        assert "code" not in queued[0].model_dump() and "logs" not in queued[0].model_dump()
        assert store.oldest_queued_at() == store.get(job.job_id).queued_at  # type: ignore[union-attr]


def test_bad_cursor_is_refused_with_a_reason() -> None:
    for bad in ("nope", "e30", encode_cursor.__name__):
        with pytest.raises(ValueError, match="next_cursor"):
            decode_cursor(bad)


def test_the_list_uses_its_index_on_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    with _store(url) as store:
        _insert(store, _rows(2000, start=datetime.now(UTC) - timedelta(days=1)))
        with store.engine.connect() as conn:
            conn.exec_driver_sql("ANALYZE")
            for where, index in [
                (RunFilter(), "ix_code_jobs_queued"),
                (RunFilter(user="user1"), "ix_code_jobs_user_queued"),
            ]:
                stmt = store_list_stmt(where)
                plan = " ".join(
                    str(r[-1]) for r in conn.execute(text("EXPLAIN QUERY PLAN " + stmt))
                )
                assert index in plan, plan
                assert "TEMP B-TREE" not in plan, plan  # no sort: the index gives the order


def store_list_stmt(where: RunFilter) -> str:
    from sqlalchemy import select
    from sqlalchemy.dialects import sqlite

    from executor.store.statements import SUMMARY_COLUMNS

    stmt = select(*SUMMARY_COLUMNS)
    if where.user:
        stmt = stmt.where(jobs.c.user == where.user)
    stmt = stmt.order_by(jobs.c.queued_at.desc(), jobs.c.job_id.desc()).limit(50)
    return str(stmt.compile(dialect=sqlite.dialect(), compile_kwargs={"literal_binds": True}))


def test_an_older_database_gets_the_new_columns_and_indexes(store_url: str) -> None:
    # The table as an older release made it: no pruned_at, no history indexes, no
    # migrations (tests/test_store_migrations.py has the stores each older release made).
    with _store(store_url) as store:
        with store.engine.begin() as conn:
            conn.exec_driver_sql("DROP TABLE code_alembic_version")
            for name in (
                "ix_code_jobs_queued",
                "ix_code_jobs_user_queued",
                "ix_code_jobs_finished",
                "ix_code_jobs_prune",
            ):
                conn.exec_driver_sql(f"DROP INDEX {name}")
            for column in ("pruned_at", "memory_bytes", "cpus"):
                conn.exec_driver_sql(f"ALTER TABLE code_jobs DROP COLUMN {column}")
            cols = {c["name"] for c in inspect(conn).get_columns("code_jobs")}
            assert not {"pruned_at", "memory_bytes", "cpus"} & cols
    with _store(store_url) as store:
        with store.engine.connect() as conn:
            cols = {c["name"] for c in inspect(conn).get_columns("code_jobs")}
            indexes = {i["name"] for i in inspect(conn).get_indexes("code_jobs")}
        assert {"pruned_at", "memory_bytes", "cpus"} <= cols
        assert {
            "ix_code_jobs_queued",
            "ix_code_jobs_user_queued",
            "ix_code_jobs_finished",
            "ix_code_jobs_prune",
        } <= indexes
        job = CodeJob(code="x", memory_bytes=64 * 1024**2, cpus=0.25)
        store.create(job, code_runtime="docker")
        rec = store.get(job.job_id)
        assert rec is not None and rec.pruned_at is None
        assert rec.memory_bytes == 64 * 1024**2 and rec.cpus == 0.25
    # opening again changes nothing and fails nothing
    open_store(store_url).close()


def _sizes(path: Path) -> tuple[int, int]:
    wal = path.with_name(path.name + "-wal")
    return path.stat().st_size, wal.stat().st_size if wal.exists() else 0


def test_retention_on_100000_rows_in_bounded_batches(store_url: str) -> None:
    from executor.settings import load_settings
    from worker.upkeep.retention import apply_retention

    now = datetime.now(UTC)
    settings = load_settings(runs_keep_days=30, runs_payload_keep_days=7, retention_batch_rows=5000)
    with _store(store_url) as store:
        old = _rows(60_000, start=now - timedelta(days=40), step_s=1)
        mid = _rows(30_000, start=now - timedelta(days=10), step_s=1)
        new = _rows(10_000, start=now - timedelta(days=1), step_s=1)
        # open jobs are never touched, however old
        stuck = _rows(5, start=now - timedelta(days=90), status="running", finished_at=None)
        _insert(store, old + mid + new + stuck)
        assert sum(store.counts_by_status().values()) == 100_005
        db = None
        if store.dialect == "sqlite":
            db = Path(store.engine.url.database or "")
            raw = store.engine.raw_connection()  # PRAGMAs outside a transaction
            try:
                assert raw.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # incremental
                raw.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
            finally:
                raw.close()
            size_before = _sizes(db)[0]

        passes = 0
        while True:
            report = apply_retention(store, settings, now=now)
            assert report is not None
            passes += 1
            # bounded: at most 20 transactions per pass, none over the batch size
            assert report.batches <= 20 and report.max_batch_rows <= 5000
            if not report.deleted and not report.payloads_cleared:
                break
            assert passes < 20
        counts = store.counts_by_status()
        assert counts["succeeded"] == 40_000 and counts["running"] == 5
        with store.engine.connect() as conn:
            left_old = conn.execute(
                text("SELECT count(*) FROM code_jobs WHERE finished_at < :t"),
                {
                    "t": (now - timedelta(days=30)).replace(tzinfo=None)
                    if store.dialect == "sqlite"
                    else now - timedelta(days=30)
                },
            ).scalar()
            cleared = conn.execute(
                text(
                    "SELECT count(*) FROM code_jobs WHERE pruned_at IS NOT NULL AND code = '' "
                    "AND output IS NULL AND logs = '' AND state_json = '{}'"
                )
            ).scalar()
        assert left_old == 0
        assert cleared == 30_000
        rec = store.get(mid[0]["job_id"])
        assert rec is not None and rec.status is Status.SUCCEEDED and rec.code == ""
        assert rec.pruned_at is not None and rec.duration_ms == 12.5
        kept = store.get(new[0]["job_id"])
        assert kept is not None and kept.code and kept.output == {"n": 1}
        if db is not None:
            size_after, wal_after = _sizes(db)
            assert wal_after == 0, "the WAL was checkpointed and truncated"
            assert size_after < size_before * 0.6, (size_before, size_after)


def test_retention_zero_keeps_everything(tmp_path: Path) -> None:
    from executor.settings import load_settings
    from worker.upkeep.retention import apply_retention, cutoffs

    s = load_settings(runs_keep_days=0, runs_payload_keep_days=0)
    assert cutoffs(s) == (None, None)
    with _store(f"sqlite:///{tmp_path / 'r.db'}") as store:
        # runs and payloads kept; the pass still runs, for expired idempotency keys only
        report = apply_retention(store, s)
        assert report is not None and (report.deleted, report.payloads_cleared) == (0, 0)
    # payloads kept longer than the rows themselves: only the rows' cutoff applies
    s = load_settings(runs_keep_days=3, runs_payload_keep_days=10)
    runs, payloads = cutoffs(s)
    assert runs is not None and payloads is None


def test_finish_and_list_agree(tmp_path: Path) -> None:
    with _store(f"sqlite:///{tmp_path / 'r.db'}") as store:
        job = CodeJob(code="x", user="a")
        store.create(job, code_runtime="subprocess")
        store.claim(job.job_id, "w")
        store.finish(
            CodeResult(
                job_id=job.job_id,
                language="python",
                status=Status.SUCCEEDED,
                runtime="subprocess",
                code_runtime="subprocess",
                duration_ms=3.0,
            ),
            worker="w",
        )
        [row] = store.list_runs(RunFilter(user="a"))
        assert row.status is Status.SUCCEEDED and row.code_runtime == "subprocess"
        assert row.finished and row.finished_at is not None and row.duration_ms == 3.0


def test_limit_caps_default_to_todays_values() -> None:
    from executor.settings import load_settings

    s = load_settings()
    assert s.max_memory_bytes == s.memory_bytes == 256 * 1024**2
    assert s.max_cpus == s.code_cpus == 0.5
    # a cap below the default never lowers the default
    assert load_settings(code_max_memory="64m").max_memory_bytes == 256 * 1024**2
    assert load_settings(code_max_memory="2g", code_max_cpus=2).max_cpus == 2
