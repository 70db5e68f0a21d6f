"""A node's retries (executor.retry): ``code_jobs.retry`` (its policy as JSON text; NULL: one
attempt), ``history`` (its attempts as a JSON list; NULL: none recorded), ``not_before_ts``
(Unix seconds before which its next attempt may not be claimed: a retry's delay, held here
so a crash cannot lose it), ``retry_sent`` (the due attempt's message was sent by a
worker's sweep) and ``claims_before`` (the claims of earlier attempts: ``attempts`` minus it
is the infrastructure's budget of the current attempt).

Revision 0004 (after 0003). Every column is nullable or has a server default, so a worker of
the release before keeps running meanwhile: it writes none of them, and a job it claims has
no retry policy.
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"


def upgrade() -> None:
    columns = {c["name"] for c in sa.inspect(op.get_bind()).get_columns("code_jobs")}
    new = [
        sa.Column("retry", sa.Text, nullable=True),
        sa.Column("history", sa.Text, nullable=True),
        sa.Column("not_before_ts", sa.Double, nullable=True),
        sa.Column("retry_sent", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("claims_before", sa.Integer, nullable=False, server_default="0"),
    ]
    for column in new:
        if column.name not in columns:
            op.add_column("code_jobs", column)
