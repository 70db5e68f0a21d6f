"""The queue's three writes per job (``create``, ``claim``, ``finish``) as plain DBAPI
statements on SQLite (sqlite3) and PostgreSQL (psycopg 3), for ``SqlRunStore``.

Why: those three run on every job's path, between the caller's submit and its answer.
Measured on this project's machines, SQLAlchemy's execution layer (connection and
transaction objects, the begin event, compiled-cache lookup, result objects) cost about
1 ms per statement group on a process that had been idle for half a second (a worker between
jobs, an API between clicks), where the same statements on the DBAPI connection cost about
0.3 ms. Everything else in the store stays on SQLAlchemy Core.

The statements are the ones ``statements.py`` builds (``CLAIM_RETURNING``,
``FINISH_RETURNING``) and ``sql.py``'s insert of ``create``, written out here for the two
dialects; the values are converted as the column types of ``schema.py`` convert them
(``UtcDateTime``, ``Boolean``, ``SafeText``), and a test compares every record this lane
returns with the record SQLAlchemy reads back from the same row, on both databases. A row
whose value cannot be converted reads as it does through SQLAlchemy (``rows.record`` falls
back to the tolerant reader: the conversion runs when the column is read, not when the row
is fetched).

The connection comes from the engine's pool (``raw_connection``): the pool's events (the
fork guard, ``pool_pre_ping``, SQLite's PRAGMAs on connect) apply as to every other call.
A connection whose statement failed is closed, not put back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

from executor.models import Status

#: one value's conversion on its way in or out (as a column type's bind/result processor)
Converter = Callable[[Any], Any]


class _LazyRow:
    """A fetched row seen as SQLAlchemy's ``Row``: ``row._mapping[name]`` and ``row.name``,
    each value converted when it is read (so an unconvertible one raises there, as
    SQLAlchemy's result processors do, and ``rows.record`` reads the row field by field)."""

    __slots__ = ("_mapping",)

    def __init__(self, mapping: Mapping[str, Any]) -> None:
        self._mapping = mapping

    def __getattr__(self, name: str) -> Any:
        try:
            return self._mapping[name]
        except KeyError:
            raise AttributeError(name) from None


class _Values(Mapping[str, Any]):
    __slots__ = ("_index", "_values", "_convert")

    def __init__(
        self, index: dict[str, int], values: tuple[Any, ...], convert: dict[str, Converter]
    ) -> None:
        self._index, self._values, self._convert = index, values, convert

    def __getitem__(self, name: str) -> Any:
        value = self._values[self._index[name]]
        fn = self._convert.get(name)
        return value if fn is None or value is None else fn(value)

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


def _sqlite_time_in(value: datetime) -> str:
    # sql.UtcDateTime + SQLAlchemy's SQLite DATETIME: naive UTC, "YYYY-MM-DD HH:MM:SS.ffffff"
    if value.tzinfo is None:
        raise ValueError("the run store only takes timezone-aware datetimes")
    return value.astimezone(UTC).replace(tzinfo=None).isoformat(" ", "microseconds")


def _sqlite_time_out(value: Any) -> datetime:
    if isinstance(value, datetime):
        parsed = value
    else:
        parsed = datetime.fromisoformat(str(value))
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)


def _pg_time_in(value: datetime) -> datetime:
    if value.tzinfo is None:
        raise ValueError("the run store only takes timezone-aware datetimes")
    return value.astimezone(UTC)


def _pg_time_out(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _pg_text(value: str | None) -> str | None:
    # sql.SafeText: PostgreSQL refuses NUL in text
    if value is not None and "\x00" in value:
        return value.replace("\x00", "\ufffd")
    return value


def _same(value: Any) -> Any:
    return value


class FastLane:
    """create / claim / finish of one job on the engine's DBAPI connections. Built by
    ``SqlRunStore`` when its dialect and driver are one of the two above and the database
    has RETURNING (SQLite >= 3.35); else the store keeps its SQLAlchemy statements.

    ``columns``: the job row's columns a record reads, in order; ``times``, ``bools``,
    ``texts``: which of the table's columns are UtcDateTime, Boolean and SafeText."""

    def __init__(
        self,
        engine: Any,
        columns: tuple[str, ...],
        *,
        times: frozenset[str],
        bools: frozenset[str],
        texts: frozenset[str],
        open_statuses: tuple[str, ...],
        cancelled_while_running: str,
    ) -> None:
        self.engine = engine
        self.sqlite = engine.dialect.name == "sqlite"
        self.columns = columns
        self._index = {name: i for i, name in enumerate(columns)}
        self.times, self.bools, self.texts = times, bools, texts
        if self.sqlite:
            self._time_in: Converter = _sqlite_time_in
            self._bool_in: Converter = int
            self._text_in: Converter = _same
            time_out: Converter = _sqlite_time_out
        else:
            self._time_in, self._bool_in, self._text_in = _pg_time_in, bool, _pg_text
            time_out = _pg_time_out
        self._convert: dict[str, Converter] = {name: time_out for name in times if name in columns}
        self._convert.update({name: bool for name in bools if name in columns})
        p = self._param
        returning = ", ".join(_q(c) for c in columns)
        self._claim = (
            f"UPDATE code_jobs SET status = {p('c_running')}, started_at = {p('c_at')}, "
            f"started_ts = {p('c_ts')}, worker = {p('c_by')}, attempts = attempts + 1 "
            f"WHERE job_id = {p('c_id')} AND status IN ({p('c_queued')}, {p('c_running')}) "
            f"RETURNING {returning}"
        )
        self._inputs = f"SELECT code, state_json FROM code_job_inputs WHERE job_id = {p('r_id')}"
        cancelling = f"status = {p('f_cancelling')}"
        open_in = ", ".join(p(f"f_open{i}") for i in range(len(open_statuses)))
        self._open = {f"f_open{i}": s for i, s in enumerate(open_statuses)}
        self._cancel_error = cancelled_while_running
        self._finish = (
            "UPDATE code_jobs SET "
            f"status = CASE WHEN {cancelling} THEN {p('f_cancelled')} ELSE {p('f_status')} END, "
            f"error = CASE WHEN {cancelling} THEN {p('f_cancel_error')} ELSE {p('f_error')} END, "
            f"output = CASE WHEN {cancelling} THEN NULL ELSE {p('f_output')} END, "
            f"logs = {p('f_logs')}, logs_truncated = {p('f_logs_truncated')}, "
            f"warnings = {p('f_warnings')}, trace = {p('f_trace')}, "
            f"exit_code = {p('f_exit_code')}, duration_ms = {p('f_duration_ms')}, "
            f"runtime = {p('f_runtime')}, code_runtime = {p('f_code_runtime')}, "
            f"finished_at = {p('f_finished_at')}, worker = {p('f_worker')} "
            f"WHERE job_id = {p('f_id')} AND status IN ({open_in}) RETURNING {returning}"
        )
        self._insert_inputs = (
            "INSERT INTO code_job_inputs (job_id, code, state_json) "
            f"VALUES ({p('job_id')}, {p('code')}, {p('state_json')})"
        )
        self._insert_job: dict[tuple[str, ...], str] = {}

    def _param(self, name: str) -> str:
        return f":{name}" if self.sqlite else f"%({name})s"

    # --- the three writes ---------------------------------------------------------------

    def create(self, values: dict[str, Any], inputs: dict[str, Any]) -> bool:
        """INSERT the job's row (nothing when its id exists) and, if it was new, its inputs'
        row, in one transaction; True when this call made it."""
        names = tuple(values)
        sql = self._insert_job.get(names)
        if sql is None:
            cols = ", ".join(_q(n) for n in names)
            params = ", ".join(self._param(n) for n in names)
            sql = (
                f"INSERT INTO code_jobs ({cols}) VALUES ({params}) "
                "ON CONFLICT (job_id) DO NOTHING RETURNING job_id"
            )
            self._insert_job[names] = sql
        bound = {name: self._bind(name, value) for name, value in values.items()}
        own = {name: self._bind(name, value) for name, value in inputs.items()}

        def work(cur: Any) -> bool:
            cur.execute(sql, bound)
            created = cur.fetchone() is not None
            if created:  # same transaction: both rows or neither
                cur.execute(self._insert_inputs, own)
            return created

        try:
            return bool(self._write(work))
        except self.engine.dialect.dbapi.IntegrityError:  # an inputs row without its job
            return False

    def claim(self, params: dict[str, Any]) -> tuple[_LazyRow, Any] | None:
        """queued/running -> running (``statements.CLAIM``); the row as written and its inputs'
        row (None: retention removed it), or None when the job was not claimable."""
        bound = {
            "c_id": params["c_id"],
            "c_at": self._time_in(params["c_at"]),
            "c_ts": params["c_ts"],
            "c_by": params["c_by"],
            "c_running": Status.RUNNING.value,
            "c_queued": Status.QUEUED.value,
        }

        def work(cur: Any) -> tuple[_LazyRow, Any] | None:
            cur.execute(self._claim, bound)
            row = cur.fetchone()
            if row is None:
                return None
            cur.execute(self._inputs, {"r_id": params["c_id"]})
            own = cur.fetchone()
            inputs = None if own is None else _LazyRow({"code": own[0], "state_json": own[1]})
            return self._row(row), inputs

        return self._write(work)  # type: ignore[no-any-return]

    def finish(self, params: dict[str, Any]) -> _LazyRow | None:
        """The result on an open job (``statements.FINISH``); the row as written, or None."""
        bound = {
            **params,
            **self._open,
            "f_cancelling": Status.CANCELLING.value,
            "f_cancelled": Status.CANCELLED.value,
            "f_cancel_error": self._text_in(self._cancel_error),
            "f_finished_at": self._time_in(params["f_finished_at"]),
            "f_logs_truncated": self._bool_in(params["f_logs_truncated"]),
        }
        for name in ("f_error", "f_output", "f_logs", "f_warnings", "f_trace"):
            bound[name] = self._text_in(bound[name])

        def work(cur: Any) -> _LazyRow | None:
            cur.execute(self._finish, bound)
            row = cur.fetchone()
            return None if row is None else self._row(row)

        return self._write(work)  # type: ignore[no-any-return]

    # --- plumbing -----------------------------------------------------------------------

    def _bind(self, column: str, value: Any) -> Any:
        if value is None:
            return None
        if column in self.times:
            return self._time_in(value)
        if column in self.bools:
            return self._bool_in(value)
        if column in self.texts:
            return self._text_in(value)
        return value

    def _row(self, values: tuple[Any, ...]) -> _LazyRow:
        return _LazyRow(_Values(self._index, tuple(values), self._convert))

    def _write(self, work: Callable[[Any], Any]) -> Any:
        """``work(cursor)`` in one write transaction (SQLite: BEGIN IMMEDIATE, as the
        store's own writes), committed; on any error rolled back and the connection closed
        (a connection that failed mid-statement is not handed to the next call)."""
        raw = self.engine.raw_connection()
        try:
            cur = raw.cursor()
            try:
                if self.sqlite:
                    cur.execute("BEGIN IMMEDIATE")
                out = work(cur)
                if self.sqlite:
                    cur.execute("COMMIT")
                else:
                    raw.commit()
            finally:
                cur.close()
        except BaseException:
            self._undo(raw)
            raise
        raw.close()  # back to the pool
        return out

    def _undo(self, raw: Any) -> None:
        """Roll back after a failed statement; a connection that cannot even do that (the
        server went away) is closed, not put back. (An in-memory SQLite store's one
        connection is never closed here: it holds the database.)"""
        try:
            if self.sqlite:
                if raw.dbapi_connection.in_transaction:
                    raw.dbapi_connection.execute("ROLLBACK")
            else:
                raw.rollback()
        except Exception:  # noqa: BLE001 - the original error is what the caller needs
            try:
                raw.invalidate()
            except Exception:  # noqa: BLE001
                pass
            return
        raw.close()


def _q(name: str) -> str:
    """A column name quoted for both dialects (``user`` is a reserved word in PostgreSQL)."""
    return '"' + name.replace('"', '""') + '"'


def lane_for(engine: Any, **kwargs: Any) -> FastLane | None:
    """The lane for ``engine``, or None when its dialect, driver or database cannot take it
    (another driver, SQLite without RETURNING): the store then uses SQLAlchemy throughout."""
    dialect = engine.dialect
    ok = (dialect.name, dialect.driver) in (("sqlite", "pysqlite"), ("postgresql", "psycopg"))
    if not ok or not (dialect.insert_returning and dialect.update_returning):
        return None
    return FastLane(engine, **kwargs)
