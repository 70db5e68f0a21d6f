"""What each run used: ``code_jobs.usage``, the host's measure of a run's peak memory, CPU
and processes (executor.models.Usage as JSON text; NULL: not measured, or a run finished
before this release).

Revision 0002 (after 0001). It runs when a store opens, in one transaction with the other
pending revisions, while workers of the release before keep running (docs/operations.md,
"Schema changes"): the column is nullable, and an older worker's finish leaves it NULL.
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    # a store that lost its version table is baselined to 0001 with its columns as they
    # are: one that already has this column keeps it
    columns = {c["name"] for c in sa.inspect(op.get_bind()).get_columns("code_jobs")}
    if "usage" not in columns:
        op.add_column("code_jobs", sa.Column("usage", sa.Text, nullable=True))
