"""Idempotent submits: ``code_idempotency``, one row per (user, key) a caller sent with a
submit (``Idempotency-Key``), naming the job that submit made and a digest of its request.

The key itself is never stored: ``key_hash`` is its SHA-256 (hex), so the table (and a dump of
it) holds no caller-chosen text. The primary key (user, key_hash) is the unique constraint two
concurrent repeats race on: one inserts, the other finds its row. ``expires_at``: after it the
key is free again (STUDIO_IDEMPOTENCY_TTL_S); retention removes expired rows.

Revision 0003 (after 0002). A new table: workers of the release before never read it, and an
API of the release before submits without keys, as it always did.
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"


def upgrade() -> None:
    if "code_idempotency" in sa.inspect(op.get_bind()).get_table_names():
        return
    op.create_table(
        "code_idempotency",
        sa.Column("user", sa.String, primary_key=True),
        sa.Column("key_hash", sa.String(64), primary_key=True),
        sa.Column("request_hash", sa.String(64), nullable=False),
        sa.Column("job_id", sa.String, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_code_idempotency_expires", "code_idempotency", ["expires_at"])
