"""The run store's schema changes: Alembic revision files in ``versions/``, applied when a
store opens (``SqlRunStore``), on SQLite and PostgreSQL alike.

* Revision ids are the files' four-digit prefixes, one line of them (``0001_schema.py``,
  ``0002_...``): which revisions this release has, and its HEAD, are known from the file
  names, so a store already at HEAD costs one SELECT of its version table at open, and
  Alembic is not even imported (``SqlRunStore`` reads it first).
* ``upgrade`` runs in the caller's write transaction, which holds the schema lock
  (PostgreSQL: an advisory lock; SQLite: ``BEGIN IMMEDIATE``, and the store's fork gate):
  of several processes opening one store at once, one applies the revisions and the others
  find the store at HEAD. Both databases roll DDL back, so a failed revision leaves the
  store as it was.
* A store made before migrations (tables, no version table) is brought to revision 0001 by
  ``baseline.py`` and stamped; then the revisions after 0001 run as for any store.
* A store at a revision this release does not know was upgraded by a newer release: it is
  used as it is (a rolling upgrade; every revision keeps older workers working, see
  docs/operations.md "Schema changes").
* The version table is ``code_alembic_version``, not Alembic's default name: the studio's
  own migrations may live in the same database.

``python -m executor.store.migrations new "what changes"`` writes the next revision file
from ``script.py.mako``; ``current`` and ``upgrade`` show and apply a store's revision.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Connection, inspect

if TYPE_CHECKING:
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

VERSION_TABLE = "code_alembic_version"
#: Alembic's script_location: script.py.mako here, the revision files in versions/
LOCATION = Path(__file__).resolve().parent
#: the step ``upgrade`` names for bringing a store made before migrations to revision 0001
BASELINE = "baseline"
#: one upgrade at a time in a process: Alembic's ``op`` is one module-level proxy
_ONE_AT_A_TIME = threading.Lock()


@functools.cache
def revisions(location: Path = LOCATION) -> tuple[str, ...]:
    """The revision ids of ``location``'s files, oldest first."""
    return tuple(sorted(p.name[:4] for p in (location / "versions").glob("[0-9]" * 4 + "_*.py")))


def head(location: Path = LOCATION) -> str:
    return revisions(location)[-1]


@functools.cache
def scripts(location: Path = LOCATION) -> ScriptDirectory:
    """Alembic's view of ``location`` (it loads every revision file once per process)."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(location))


def context(conn: Connection) -> MigrationContext:
    """Alembic's migration context on ``conn``, inside the transaction ``conn`` is in."""
    from alembic.runtime.migration import MigrationContext

    # transactional_ddl: true of SQLite too (Alembic assumes not, but its DDL rolls back)
    opts = {"version_table": VERSION_TABLE, "transactional_ddl": True}
    return MigrationContext.configure(connection=conn, opts=opts)


def upgrade(conn: Connection, location: Path = LOCATION) -> tuple[str, ...]:
    """The store on ``conn`` brought to ``location``'s HEAD, in ``conn``'s transaction (which
    must hold the schema lock, see above). Returns the steps applied: ``()`` when the store
    was at HEAD or at a revision newer than this release."""
    from alembic.operations import Operations

    from executor.store.migrations import baseline

    known = revisions(location)
    ctx = context(conn)
    heads = ctx.get_current_heads()
    if len(heads) > 1:  # pragma: no cover - every revision has one parent
        raise RuntimeError(f"the run store's {VERSION_TABLE} holds several revisions: {heads}")
    at = heads[0] if heads else None
    if at == known[-1] or (at is not None and at not in known):
        return ()
    script = scripts(location)
    steps: list[str] = []
    with _ONE_AT_A_TIME, Operations.context(ctx) as op:
        if at is None and inspect(conn).has_table("code_jobs"):
            baseline.bring_up(conn, op, script.get_revision(known[0]).module.schema)
            ctx.stamp(script, known[0])
            at = known[0]
            steps.append(BASELINE)
        for revision in known[known.index(at) + 1 :] if at is not None else known:
            script.get_revision(revision).module.upgrade()
            ctx.stamp(script, revision)
            steps.append(revision)
    return tuple(steps)
