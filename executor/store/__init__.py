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
    Claim,
    Ended,
    JobRecord,
    KeyedJob,
    PruneReport,
    QueuedJob,
    RunFilter,
    RunStore,
    RunSummary,
    decode_cursor,
    encode_cursor,
)
from executor.store.sql import SqlRunStore, describe_url


def open_store(url: str, *, create: bool = True) -> RunStore:
    """The run store at ``url`` (a SQLAlchemy URL), its schema made or brought to this
    release's (``executor.store.migrations``). With ``create=False`` nothing is created or
    changed (no folder, no file, no table): a SQLite file that does not exist raises
    StoreUnavailable naming it."""
    return SqlRunStore(url, create_tables=create)


__all__ = [
    "CANCELLED_BEFORE_START",
    "CANCELLED_WHILE_RUNNING",
    "OPEN_STATUSES",
    "WORKER_STOPPED",
    "AuditEntry",
    "Claim",
    "Ended",
    "JobRecord",
    "KeyedJob",
    "QueuedJob",
    "PruneReport",
    "RunFilter",
    "RunStore",
    "RunSummary",
    "decode_cursor",
    "encode_cursor",
    "SqlRunStore",
    "describe_url",
    "open_store",
]
