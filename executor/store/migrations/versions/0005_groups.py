"""A job's worker group (executor.groups): ``code_jobs.worker_group`` (NULL: the default
group), so a message sent again (a retry's next attempt, a lost message) goes to the queue of
the group the job was sent to first.

Revision 0005 (after 0004). The column is nullable, so a worker of the release before keeps
running meanwhile: it writes none, and a job it reads is of the default group.
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"


def upgrade() -> None:
    columns = {c["name"] for c in sa.inspect(op.get_bind()).get_columns("code_jobs")}
    if "worker_group" not in columns:
        op.add_column("code_jobs", sa.Column("worker_group", sa.String(32), nullable=True))
