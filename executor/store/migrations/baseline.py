"""A store made before migrations, brought to revision 0001's schema (then stamped 0001).

Releases before migrations made their tables with ``create_all`` and grew them at open; a
store can be at any of their steps (they were built on parallel branches, so not in one
order): no ``pruned_at``, ``memory_bytes``, ``cpus``, no history indexes, no
``code_store``, no ``code_job_inputs``. Each missing piece is added here, once:

* a missing table, with its indexes;
* a missing column (all were nullable) and a missing index;
* the code and state of rows made before ``code_job_inputs`` existed, moved there from
  ``code_jobs`` (which then holds "" and "{}" like every newer row): they read as before,
  and no read has to look in two places.
"""

from __future__ import annotations

from alembic.operations import Operations
from sqlalchemy import Connection, MetaData, inspect, text

#: rows whose code and state are still in code_jobs: the releases before code_job_inputs
_MOVE_INPUTS = """
INSERT INTO code_job_inputs (job_id, code, state_json)
SELECT j.job_id, j.code, j.state_json FROM code_jobs j
WHERE (j.code <> '' OR j.state_json <> '{}')
  AND NOT EXISTS (SELECT 1 FROM code_job_inputs i WHERE i.job_id = j.job_id)
"""
_CLEAR_MOVED = """
UPDATE code_jobs SET code = '', state_json = '{}' WHERE code <> '' OR state_json <> '{}'
"""


def bring_up(conn: Connection, op: Operations, schema: MetaData) -> None:
    """``conn``'s store, which has a ``code_jobs`` table, as ``schema`` (revision 0001's)."""
    have_tables = set(inspect(conn).get_table_names())
    schema.create_all(conn, tables=[t for t in schema.sorted_tables if t.name not in have_tables])
    for table in schema.sorted_tables:
        if table.name not in have_tables:
            continue
        seen = inspect(conn)  # a fresh inspector: it caches what it read
        columns = {c["name"] for c in seen.get_columns(table.name)}
        for column in table.columns:
            if column.name not in columns:
                if not column.nullable:  # pragma: no cover - no release made such a table
                    raise RuntimeError(f"the run store lacks the NOT NULL column {column.name}")
                op.add_column(table.name, column._copy())
        indexes = {i["name"] for i in seen.get_indexes(table.name)}
        for index in table.indexes:
            if index.name not in indexes:
                index.create(conn)
    conn.execute(text(_MOVE_INPUTS))
    conn.execute(text(_CLEAR_MOVED))
