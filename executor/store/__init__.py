"""The run store: where Code-node jobs and their results live (see ``base.RunStore``).

``open_store(settings.sqlalchemy_url)`` gives a SQLite file store by default
(STUDIO_DATA_DIR/studio-code.db) or a PostgreSQL one (STUDIO_DATABASE_URL=
``postgresql+psycopg://user:pass@host/db``) when workers run on many machines.
"""

from __future__ import annotations

from executor.store.base import (
    CANCELLED_BEFORE_START,
    CANCELLED_WHILE_RUNNING,
    OPEN_STATUSES,
    WORKER_STOPPED,
    AuditEntry,
    JobRecord,
    PruneReport,
    RunFilter,
    RunStore,
    RunSummary,
    decode_cursor,
    encode_cursor,
)
from executor.store.sql import SqlRunStore


def open_store(url: str) -> RunStore:
    """The run store at ``url`` (a SQLAlchemy URL), its tables created when missing."""
    return SqlRunStore(url)


__all__ = [
    "CANCELLED_BEFORE_START",
    "CANCELLED_WHILE_RUNNING",
    "OPEN_STATUSES",
    "WORKER_STOPPED",
    "AuditEntry",
    "JobRecord",
    "PruneReport",
    "RunFilter",
    "RunStore",
    "RunSummary",
    "decode_cursor",
    "encode_cursor",
    "SqlRunStore",
    "open_store",
]
