"""The run store's schema as this release's code reads and writes it: the column types and
the tables (``metadata``). The schema itself is made and changed by migrations
(``executor/store/migrations``); ``metadata`` is what the newest revision makes, and a test
compares the two. Lists and dicts are stored as JSON text so the schema is the same on both
databases.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Double,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    false,
)
from sqlalchemy.types import TypeDecorator

# --- column types ------------------------------------------------------------------------


class UtcDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes in, aware UTC datetimes out. PostgreSQL: timestamptz; SQLite: the
    naive UTC wall time (SQLite has no time zones)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("the run store only takes timezone-aware datetimes")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class SafeText(TypeDecorator[str]):
    """Text that PostgreSQL accepts: it refuses NUL characters, which printed output may
    hold, so they become U+FFFD there (SQLite keeps them)."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Any) -> str | None:
        if value is not None and dialect.name == "postgresql" and "\x00" in value:
            return value.replace("\x00", "\ufffd")
        return value


# --- schema ------------------------------------------------------------------------------

metadata = MetaData()

jobs = Table(
    "code_jobs",
    metadata,
    Column("job_id", String, primary_key=True),
    Column("status", String(16), nullable=False),
    Column("kind", String(8), nullable=False, default="run"),
    Column("user", String, nullable=False, default=""),
    Column("language", String(16), nullable=False),
    Column("code", SafeText, nullable=False),
    Column("state_json", SafeText, nullable=False),
    Column("timeout_s", Double, nullable=True),
    Column("code_runtime", String, nullable=False, default=""),
    Column("runtime", String, nullable=True),
    Column("output", SafeText, nullable=True),  # JSON text
    Column("error", SafeText, nullable=True),  # CodeErrorInfo as JSON text
    Column("logs", SafeText, nullable=False, default=""),
    Column("logs_truncated", Boolean, nullable=False, default=False),
    Column("warnings", SafeText, nullable=False, default="[]"),  # JSON list of str
    Column("trace", SafeText, nullable=False, default="[]"),  # JSON list of TraceRow
    Column("exit_code", Integer, nullable=True),
    Column("duration_ms", Double, nullable=True),
    Column("queued_at", UtcDateTime, nullable=False),
    Column("started_at", UtcDateTime, nullable=True),
    Column("finished_at", UtcDateTime, nullable=True),
    # started_at as Unix seconds: lets fail_stuck compare deadlines with plain arithmetic
    # that both databases evaluate the same way.
    Column("started_ts", Double, nullable=True),
    Column("worker", String, nullable=True),
    Column("attempts", Integer, nullable=False, default=0),
    # Added after the first release (a store made before migrations gets them from
    # migrations/baseline.py).
    Column("pruned_at", UtcDateTime, nullable=True),  # retention cleared the payloads
    Column("memory_bytes", BigInteger, nullable=True),  # what the node asked for, if any
    Column("cpus", Double, nullable=True),
    Column("usage", SafeText, nullable=True),  # Usage as JSON text (migration 0002)
    # A node's retries (migration 0004, executor.retry): its policy and attempts as JSON
    # text, the Unix time before which its next attempt may not be claimed, whether a sweep
    # sent that attempt's message, and the claims of its earlier attempts.
    Column("retry", SafeText, nullable=True),
    Column("history", SafeText, nullable=True),
    Column("not_before_ts", Double, nullable=True),
    Column("retry_sent", Boolean, nullable=False, server_default=false()),
    Column("claims_before", Integer, nullable=False, server_default="0"),
    # The job's worker group (migration 0005, executor.groups; NULL: default).
    Column("worker_group", String(32), nullable=True),
    # The run's concurrency keys (migration 0006, worker.fair; NULL: none; executor.keys:
    # at most 64 characters), so a message sent again from the row takes its own lane.
    Column("tenant", String(64), nullable=True),
    Column("workflow", String(64), nullable=True),
    Index("ix_code_jobs_status", "status"),
    # Run history, newest first, with a keyset cursor: all runs (admins) and one user's.
    Index("ix_code_jobs_queued", "queued_at", "job_id"),
    Index("ix_code_jobs_user_queued", "user", "queued_at", "job_id"),
    # Retention: runs finished before a cutoff; payloads not cleared yet (NULL first).
    Index("ix_code_jobs_finished", "finished_at"),
    Index("ix_code_jobs_prune", "pruned_at", "finished_at"),
)

#: A job's code and state, out of ``code_jobs``: the queue updates that row twice per job
#: (claim, finish) and SQLite rewrites a whole row on every UPDATE, so a 10 MB state was
#: copied twice per job; and the reads that need neither (status, wait, views) never touch
#: them. Written once by ``create``, read once by ``claim``, removed by retention (a job with
#: no row here reads "" and "{}"). ``code_jobs.code``/``state_json`` hold "" and "{}": rows
#: made before this table had theirs moved here by migrations/baseline.py.
job_inputs = Table(
    "code_job_inputs",
    metadata,
    Column("job_id", String, primary_key=True),
    Column("code", SafeText, nullable=False),
    Column("state_json", SafeText, nullable=False),
)

audit_log = Table(
    "code_audit",
    metadata,
    Column(
        "id",
        BigInteger().with_variant(Integer, "sqlite"),  # INTEGER PRIMARY KEY = rowid on SQLite
        primary_key=True,
        autoincrement=True,
    ),
    Column("at", UtcDateTime, nullable=False),
    Column("event", String, nullable=False),
    Column("actor", String, nullable=False),
    Column("details", SafeText, nullable=False),  # JSON object
    Index("ix_code_audit_event_id", "event", "id"),
)


#: idempotent submits (migration 0003): the job a (user, key) made, and a digest of that
#: submit's request; the key is stored as its SHA-256 only. The primary key is the unique
#: constraint concurrent repeats race on.
idempotency = Table(
    "code_idempotency",
    metadata,
    Column("user", String, primary_key=True),
    Column("key_hash", String(64), primary_key=True),
    Column("request_hash", String(64), nullable=False),
    Column("job_id", String, nullable=False),
    Column("created_at", UtcDateTime, nullable=False),
    Column("expires_at", UtcDateTime, nullable=False),
    Index("ix_code_idempotency_expires", "expires_at"),
)


#: one row per fact about the store itself; ``store_id`` is written once, at creation
store_meta = Table(
    "code_store",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)

#: the ``code_store`` key of the store's id
STORE_ID = "store_id"
#: the inputs' columns: in ``job_inputs``; in ``code_jobs`` too, never read from there
INPUTS = ("code", "state_json")
#: ``code_jobs`` without the inputs' columns (see ``job_inputs``)
JOB_COLUMNS = tuple(c for c in jobs.columns if c.name not in INPUTS)
