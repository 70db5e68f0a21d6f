"""The queue's three writes per job (``create``, ``claim``, ``finish``) on the engine's DBAPI
connection (sqlite3 or psycopg 3), for ``SqlRunStore``.

Why: those three run on every job's path, between the caller's submit and its answer.
Measured on this project's machines, SQLAlchemy's execution layer (connection and
transaction objects, the begin event, compiled-cache lookup, result objects) cost about
1 ms per statement group on a process that had been idle for half a second (a worker between
jobs, an API between clicks), where the same statements on the DBAPI connection cost about
0.3 ms. Everything else in the store stays on SQLAlchemy Core.

Nothing here is written twice: the statements are ``statements.py``'s (``insert_job``,
``INSERT_INPUTS``, ``CLAIM_RETURNING``, ``SELECT_INPUTS``, ``FINISH_RETURNING``), compiled
once per lane for the engine's dialect (``Prepared``: its SQL text in the DBAPI's
paramstyle, its parameters in order), and every value goes through its type's own bind and
result processors (``UtcDateTime``, ``SafeText``, the dialect's ``DateTime`` and
``Boolean``), as SQLAlchemy's execution would apply them. A test compares every record this
lane returns with the record SQLAlchemy reads back from the same row, on both databases. A
row whose value cannot be converted reads as it does through SQLAlchemy (``rows.record``
falls back to the tolerant reader: the conversion runs when the column is read, not when
the row is fetched).

The connection comes from the engine's pool (``raw_connection``): the pool's events (the
fork guard, ``pool_pre_ping``, SQLite's PRAGMAs on connect) apply as to every other call.
A connection whose statement failed is closed, not put back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import cached_property
from operator import itemgetter
from typing import Any

from executor.store import statements as st

#: one value's conversion on its way in or out (a column type's bind/result processor)
Converter = Callable[[Any], Any]


class Prepared:
    """One SQLAlchemy statement as the DBAPI takes it on ``dialect``: ``sql``, its text in
    the dialect's paramstyle (IN lists of the statement's own values expanded, as
    ``render_postcompile`` would), and ``params(values)``, the parameters in the form that
    paramstyle wants (a tuple in ``positiontup``'s order, or a dict), each value passed
    through its type's bind processor. The values the statement holds itself (its
    literals: the statuses, the cancel's error) are converted once, here. ``columns``: what
    its rows hold, converted by ``row`` with the columns' result processors."""

    def __init__(self, stmt: Any, dialect: Any, column_keys: Sequence[str] | None = None) -> None:
        compiled = stmt.compile(dialect=dialect, column_keys=column_keys)
        #: the parameters the caller gives (the others are the statement's own)
        given = {name for name, bind in compiled.binds.items() if bind.required}
        expanded = compiled.construct_expanded_state(dict.fromkeys(given))
        self.sql: str = expanded.statement
        self._dialect = dialect
        own = dict(expanded.parameters)
        # an INSERT's columns not given take their defaults (as SQLAlchemy's execution fills
        # them in): the store gives every column, but a default is never bound as NULL
        for column in getattr(compiled, "insert_prefetch", ()):
            if column.default is None or not column.default.is_scalar:
                raise ValueError(f"{column.key} has no value and no scalar default")
            own[column.key] = column.default.arg
        convert: dict[str, Converter] = {}
        for name, bind in compiled.binds.items():
            process = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if process is not None:
                for each in expanded.parameter_expansion.get(name, [name]):
                    convert[each] = process
        #: the caller's parameters, each with its conversion (None: taken as it is)
        self._given = tuple((name, convert.get(name)) for name in sorted(given))
        self._fixed = {
            name: convert[name](value) if name in convert else value
            for name, value in own.items()
            if name not in given
        }
        #: positional paramstyles (SQLite's qmark): the values in the statement's order
        self._order: Callable[[dict[str, Any]], Any] | None = None
        if compiled.positional:
            pick = itemgetter(*expanded.positiontup)
            one = len(expanded.positiontup) == 1
            self._order = (lambda bound: (pick(bound),)) if one else pick
        self._columns = tuple(stmt.exported_columns)  # a SELECT's columns, or RETURNING's
        self._index = {c.key: i for i, c in enumerate(self._columns)}
        self._results: dict[str, Converter] | None = None

    def params(self, values: Mapping[str, Any]) -> Any:
        """The parameters of one execution (``values``: the caller's, by bind name; a name
        the statement does not take is left out, as SQLAlchemy does)."""
        bound = self._fixed.copy()
        for name, fn in self._given:
            value = values[name]
            bound[name] = value if fn is None else fn(value)
        return bound if self._order is None else self._order(bound)

    def row(self, values: Sequence[Any], cur: Any) -> _LazyRow:
        """A row ``cur`` fetched, its values converted by their columns' result processors
        when read (the processors looked up once, from the first cursor's type codes, as
        SQLAlchemy does per compiled statement: psycopg builds ``description`` anew at each
        read, 25 column objects, so it is read only then)."""
        if self._results is None:
            results: dict[str, Converter] = {}
            for column, described in zip(self._columns, cur.description, strict=True):
                impl = column.type.dialect_impl(self._dialect)
                fn = impl.result_processor(self._dialect, described[1])
                if fn is not None:
                    results[column.key] = fn
            self._results = results
        return _LazyRow(_Values(self._index, tuple(values), self._results))


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
        return value if fn is None or value is None else fn(value)  # NULL reads as None

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


class FastLane:
    """create / claim / finish of one job on the engine's DBAPI connections. Built by
    ``SqlRunStore`` when its dialect and driver are one of the two above and the database
    has RETURNING (SQLite >= 3.35); else the store keeps its SQLAlchemy statements. Each
    statement is compiled on its first use."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.dialect = engine.dialect
        self.sqlite = engine.dialect.name == "sqlite"
        #: create's INSERT of the job row, per set of columns given (as SQLAlchemy compiles
        #: an insert for the keys of the values it is executed with)
        self._insert_job: dict[tuple[str, ...], Prepared] = {}

    @cached_property
    def _claim(self) -> Prepared:
        return Prepared(st.CLAIM_RETURNING, self.dialect)

    @cached_property
    def _unclaimed(self) -> Prepared:
        return Prepared(st.SELECT_UNCLAIMED, self.dialect)

    @cached_property
    def _finish(self) -> Prepared:
        return Prepared(st.FINISH_RETURNING, self.dialect)

    @cached_property
    def _inputs(self) -> Prepared:
        return Prepared(st.SELECT_INPUTS, self.dialect)

    @cached_property
    def _insert_inputs(self) -> Prepared:
        return Prepared(st.INSERT_INPUTS, self.dialect, ("job_id", "code", "state_json"))

    # --- the three writes ---------------------------------------------------------------

    def create(self, values: dict[str, Any], inputs: dict[str, Any]) -> bool:
        """INSERT the job's row (nothing when its id exists) and, if it was new, its inputs'
        row, in one transaction; True when this call made it."""
        names = tuple(values)
        job = self._insert_job.get(names)
        if job is None:
            job = Prepared(st.insert_job(self.dialect), self.dialect, names)
            self._insert_job[names] = job
        own = self._insert_inputs

        def work(cur: Any) -> bool:
            cur.execute(job.sql, job.params(values))
            created = cur.fetchone() is not None
            if created:  # same transaction: both rows or neither
                cur.execute(own.sql, own.params(inputs))
            return created

        try:
            return bool(self._write(work))
        except self.dialect.dbapi.IntegrityError:  # an inputs row without its job
            return False

    def claim(
        self, params: dict[str, Any]
    ) -> tuple[_LazyRow, _LazyRow | None] | tuple[None, _LazyRow | None]:
        """queued/running -> running (``statements.CLAIM``); the row as written and its
        inputs' row (None: retention removed it), or, when the job was not claimable,
        None and the row as the claim found it (``statements.SELECT_UNCLAIMED``; None: no
        such job), in the same transaction."""
        claim, inputs, unclaimed = self._claim, self._inputs, self._unclaimed

        def work(cur: Any) -> tuple[Any, _LazyRow | None]:
            cur.execute(claim.sql, claim.params(params))
            row = cur.fetchone()
            if row is None:
                cur.execute(unclaimed.sql, unclaimed.params({"r_id": params["c_id"]}))
                found = cur.fetchone()
                return None, None if found is None else unclaimed.row(found, cur)
            claimed = claim.row(row, cur)
            cur.execute(inputs.sql, inputs.params({"r_id": params["c_id"]}))
            own = cur.fetchone()
            return claimed, None if own is None else inputs.row(own, cur)

        return self._write(work)  # type: ignore[no-any-return]

    def finish(self, params: dict[str, Any]) -> _LazyRow | None:
        """The result on an open job (``statements.FINISH``); the row as written, or None."""
        finish = self._finish

        def work(cur: Any) -> _LazyRow | None:
            cur.execute(finish.sql, finish.params(params))
            row = cur.fetchone()
            return None if row is None else finish.row(row, cur)

        return self._write(work)  # type: ignore[no-any-return]

    # --- plumbing -----------------------------------------------------------------------

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


def lane_for(engine: Any) -> FastLane | None:
    """The lane for ``engine``, or None when its dialect, driver or database cannot take it
    (another driver, SQLite without RETURNING): the store then uses SQLAlchemy throughout."""
    dialect = engine.dialect
    ok = (dialect.name, dialect.driver) in (("sqlite", "pysqlite"), ("postgresql", "psycopg"))
    if not ok or not (dialect.insert_returning and dialect.update_returning):
        return None
    return FastLane(engine)
