"""A workflow run's concurrency keys (worker.fair, executor.keys): ``code_jobs.tenant`` and
``code_jobs.workflow`` (NULL: none), so a message sent again from the row (the queued
sweep's resend of a lost message, a retry's next attempt) goes to the run's own lane, under
its tenant's and workflow's caps, even when Redis lost the run's fair state.

Revision 0006 (after 0005). The columns are nullable, so a worker or API of the release
before keeps running meanwhile: it writes none, and a run it submitted comes back on its
user's lane as before.
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"


def upgrade() -> None:
    columns = {c["name"] for c in sa.inspect(op.get_bind()).get_columns("code_jobs")}
    for name in ("tenant", "workflow"):
        if name not in columns:
            op.add_column("code_jobs", sa.Column(name, sa.String(64), nullable=True))
