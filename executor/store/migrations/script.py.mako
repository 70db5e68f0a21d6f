"""${message}

Revision ${up_revision} (after ${down_revision}), written ${create_date}. It runs when a
store opens, in one transaction with the other pending revisions, while workers of the
release before keep running (docs/operations.md, "Schema changes"): a new column is
nullable or has a server_default; nothing is dropped or renamed in the release that stops
using it (a later release does, once no older worker runs).
"""

import sqlalchemy as sa
from alembic import op

revision = "${up_revision}"
down_revision = "${down_revision}"


def upgrade() -> None:
    ${upgrades if upgrades else "pass"}
