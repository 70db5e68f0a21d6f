"""The run store's schema when migrations began: four tables, made from nothing.

A store made before migrations (its tables, no version table) is brought to this schema by
``baseline.py`` instead and stamped 0001.

Frozen: a later change of the schema is a new revision, never an edit here (``schema`` is
also what baseline.py brings an older store to).
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None

#: timezone-aware UTC times: timestamptz on PostgreSQL, the naive UTC wall time on SQLite
_AT = sa.DateTime(timezone=True)

schema = sa.MetaData()

sa.Table(
    "code_jobs",
    schema,
    sa.Column("job_id", sa.String, primary_key=True),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("kind", sa.String(8), nullable=False),
    sa.Column("user", sa.String, nullable=False),
    sa.Column("language", sa.String(16), nullable=False),
    # written "" and "{}" since code_job_inputs holds them; kept for workers of the release
    # before migrations, which still write them
    sa.Column("code", sa.Text, nullable=False),
    sa.Column("state_json", sa.Text, nullable=False),
    sa.Column("timeout_s", sa.Double, nullable=True),
    sa.Column("code_runtime", sa.String, nullable=False),
    sa.Column("runtime", sa.String, nullable=True),
    sa.Column("output", sa.Text, nullable=True),
    sa.Column("error", sa.Text, nullable=True),
    sa.Column("logs", sa.Text, nullable=False),
    sa.Column("logs_truncated", sa.Boolean, nullable=False),
    sa.Column("warnings", sa.Text, nullable=False),
    sa.Column("trace", sa.Text, nullable=False),
    sa.Column("exit_code", sa.Integer, nullable=True),
    sa.Column("duration_ms", sa.Double, nullable=True),
    sa.Column("queued_at", _AT, nullable=False),
    sa.Column("started_at", _AT, nullable=True),
    sa.Column("finished_at", _AT, nullable=True),
    sa.Column("started_ts", sa.Double, nullable=True),
    sa.Column("worker", sa.String, nullable=True),
    sa.Column("attempts", sa.Integer, nullable=False),
    # added by releases before migrations (nullable: baseline.py adds them to older stores)
    sa.Column("pruned_at", _AT, nullable=True),
    sa.Column("memory_bytes", sa.BigInteger, nullable=True),
    sa.Column("cpus", sa.Double, nullable=True),
    sa.Index("ix_code_jobs_status", "status"),
    sa.Index("ix_code_jobs_queued", "queued_at", "job_id"),
    sa.Index("ix_code_jobs_user_queued", "user", "queued_at", "job_id"),
    sa.Index("ix_code_jobs_finished", "finished_at"),
    sa.Index("ix_code_jobs_prune", "pruned_at", "finished_at"),
)

sa.Table(
    "code_job_inputs",
    schema,
    sa.Column("job_id", sa.String, primary_key=True),
    sa.Column("code", sa.Text, nullable=False),
    sa.Column("state_json", sa.Text, nullable=False),
)

sa.Table(
    "code_audit",
    schema,
    sa.Column(
        "id",
        sa.BigInteger().with_variant(sa.Integer, "sqlite"),  # INTEGER PRIMARY KEY = rowid
        primary_key=True,
        autoincrement=True,
    ),
    sa.Column("at", _AT, nullable=False),
    sa.Column("event", sa.String, nullable=False),
    sa.Column("actor", sa.String, nullable=False),
    sa.Column("details", sa.Text, nullable=False),
    sa.Index("ix_code_audit_event_id", "event", "id"),
)

sa.Table(
    "code_store",
    schema,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
)


def upgrade() -> None:
    schema.create_all(op.get_bind())
