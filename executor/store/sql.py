"""The run store on SQLAlchemy Core: a SQLite file by default, PostgreSQL for many machines.

Concurrency rules (see base.py): every state change is one conditional UPDATE whose rowcount
says whether this caller won. On PostgreSQL (READ COMMITTED) a concurrent UPDATE of the same
row waits for the row lock and re-checks the WHERE clause against the committed row, so only
one of two racing writers matches. On SQLite every write transaction starts with
``BEGIN IMMEDIATE`` (the database write lock is taken up front and waited for with
busy_timeout), so writers are serialised and never hit SQLite's lock-upgrade deadlock; reads
use a plain deferred ``BEGIN`` and, with WAL, never block or wait for writers.

Lists and dicts are stored as JSON text so the schema is the same on both databases. The
schema is made and changed by migrations (``executor/store/migrations``: Alembic revision
files) when a store opens; ``metadata`` below is what the newest revision makes, and a test
compares the two.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Collection, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Connection,
    DateTime,
    Double,
    Engine,
    Index,
    Integer,
    MetaData,
    Row,
    String,
    Table,
    Text,
    and_,
    bindparam,
    case,
    create_engine,
    delete,
    event,
    exc,
    func,
    insert,
    literal,
    literal_column,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import StaticPool
from sqlalchemy.types import TypeDecorator

from executor.errors import ErrorCode, StoreUnavailable
from executor.models import (
    FINISHED,
    CodeErrorInfo,
    CodeJob,
    CodeResult,
    Kind,
    Status,
    TraceRow,
    Usage,
)
from executor.outputs import (
    OutputInvalid,
    check_value,
    may_hold_lone_surrogate,
    safe_text,
    safe_value,
)
from executor.store import migrations
from executor.store.base import (
    CANCELLED_BEFORE_START,
    CANCELLED_WHILE_RUNNING,
    OPEN_STATUSES,
    WORKER_STOPPED,
    AuditEntry,
    Ended,
    JobRecord,
    PruneReport,
    QueuedJob,
    RunFilter,
    RunStore,
    RunSummary,
)
from executor.store.fast import FastLane, lane_for
from executor.store.guard import raise_store_outages

log = logging.getLogger("studio_code.store")

_READ_ONLY = "studio_read_only"  # execution option: a read transaction (plain BEGIN on SQLite)
_SQLITE_BUSY_TIMEOUT_MS = 30_000
#: SQLite: a commit checkpoints the WAL itself only past this many pages (64 MiB of 4 KiB
#: pages; SQLite's default is 1000); below it, _Checkpointer does it off the commit's path
_SQLITE_AUTOCHECKPOINT_PAGES = 16_384
_SQLITE_CHECKPOINT_AFTER_S = 0.5
#: pg_advisory_xact_lock key serialising schema changes at open (the releases before
#: migrations take the same one around their create_all: a rolling upgrade is serialised too)
_PG_SCHEMA_LOCK = 0x5374_7564_696F
_CHUNK = 500  # ids per IN (...) in get_many


# --- column types ------------------------------------------------------------------------


class UtcDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes in, aware UTC datetimes out. PostgreSQL: timestamptz; SQLite: the
    naive UTC wall time (SQLite has no time zones)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("the run store only takes timezone-aware datetimes")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class SafeText(TypeDecorator[str]):
    """Text that PostgreSQL accepts: it refuses NUL characters, which printed output may
    hold, so they become U+FFFD there (SQLite keeps them)."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Any) -> str | None:
        if value is not None and dialect.name == "postgresql" and "\x00" in value:
            return value.replace("\x00", "\ufffd")
        return value


# --- schema ------------------------------------------------------------------------------

metadata = MetaData()

jobs = Table(
    "code_jobs",
    metadata,
    Column("job_id", String, primary_key=True),
    Column("status", String(16), nullable=False),
    Column("kind", String(8), nullable=False, default="run"),
    Column("user", String, nullable=False, default=""),
    Column("language", String(16), nullable=False),
    Column("code", SafeText, nullable=False),
    Column("state_json", SafeText, nullable=False),
    Column("timeout_s", Double, nullable=True),
    Column("code_runtime", String, nullable=False, default=""),
    Column("runtime", String, nullable=True),
    Column("output", SafeText, nullable=True),  # JSON text
    Column("error", SafeText, nullable=True),  # CodeErrorInfo as JSON text
    Column("logs", SafeText, nullable=False, default=""),
    Column("logs_truncated", Boolean, nullable=False, default=False),
    Column("warnings", SafeText, nullable=False, default="[]"),  # JSON list of str
    Column("trace", SafeText, nullable=False, default="[]"),  # JSON list of TraceRow
    Column("exit_code", Integer, nullable=True),
    Column("duration_ms", Double, nullable=True),
    Column("queued_at", UtcDateTime, nullable=False),
    Column("started_at", UtcDateTime, nullable=True),
    Column("finished_at", UtcDateTime, nullable=True),
    # started_at as Unix seconds: lets fail_stuck compare deadlines with plain arithmetic
    # that both databases evaluate the same way.
    Column("started_ts", Double, nullable=True),
    Column("worker", String, nullable=True),
    Column("attempts", Integer, nullable=False, default=0),
    # Added after the first release (a store made before migrations gets them from
    # migrations/baseline.py).
    Column("pruned_at", UtcDateTime, nullable=True),  # retention cleared the payloads
    Column("memory_bytes", BigInteger, nullable=True),  # what the node asked for, if any
    Column("cpus", Double, nullable=True),
    Column("usage", SafeText, nullable=True),  # Usage as JSON text (migration 0002)
    Index("ix_code_jobs_status", "status"),
    # Run history, newest first, with a keyset cursor: all runs (admins) and one user's.
    Index("ix_code_jobs_queued", "queued_at", "job_id"),
    Index("ix_code_jobs_user_queued", "user", "queued_at", "job_id"),
    # Retention: runs finished before a cutoff; payloads not cleared yet (NULL first).
    Index("ix_code_jobs_finished", "finished_at"),
    Index("ix_code_jobs_prune", "pruned_at", "finished_at"),
)

#: A job's code and state, out of ``code_jobs``: the queue updates that row twice per job
#: (claim, finish) and SQLite rewrites a whole row on every UPDATE, so a 10 MB state was
#: copied twice per job; and the reads that need neither (status, wait, views) never touch
#: them. Written once by ``create``, read once by ``claim``, removed by retention (a job with
#: no row here reads "" and "{}"). ``code_jobs.code``/``state_json`` hold "" and "{}": rows
#: made before this table had theirs moved here by migrations/baseline.py.
job_inputs = Table(
    "code_job_inputs",
    metadata,
    Column("job_id", String, primary_key=True),
    Column("code", SafeText, nullable=False),
    Column("state_json", SafeText, nullable=False),
)

audit_log = Table(
    "code_audit",
    metadata,
    Column(
        "id",
        BigInteger().with_variant(Integer, "sqlite"),  # INTEGER PRIMARY KEY = rowid on SQLite
        primary_key=True,
        autoincrement=True,
    ),
    Column("at", UtcDateTime, nullable=False),
    Column("event", String, nullable=False),
    Column("actor", String, nullable=False),
    Column("details", SafeText, nullable=False),  # JSON object
    Index("ix_code_audit_event_id", "event", "id"),
)


#: one row per fact about the store itself; ``store_id`` is written once, at creation
store_meta = Table(
    "code_store",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)

_STORE_ID = "store_id"


# --- helpers -----------------------------------------------------------------------------


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _dumps(value: Any) -> str:
    # ensure_ascii keeps lone surrogates and NULs escaped: the text is always storable.
    return json.dumps(value, separators=(",", ":"))


def _storable(value: str) -> str:
    """``value`` without lone surrogates (neither database can encode them)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "replace").decode("utf-8")
    return value


def _error_json(error: CodeErrorInfo | None) -> str | None:
    # not model_dump_json: pydantic refuses to encode a lone surrogate, and a node's own
    # error message can hold one (it becomes U+FFFD here; _dumps escapes NUL)
    if error is None:
        return None
    return _dumps({"code": str(error.code), "message": safe_text(error.message)})


def _output_json(result: CodeResult) -> tuple[str | None, CodeErrorInfo | None]:
    """The output as JSON text, or (None, why) for a value no route could render: nested
    deeper than OUTPUT_MAX_DEPTH, a lone surrogate, NaN, an unserialisable object. The
    executor refuses these before they get here; a CodeResult made elsewhere must still
    never make the write fail (a failed write would leave the run ``running``)."""
    if result.output is None:
        return None, None
    try:
        text = _dumps_strict(result.output)
        check_value(result.output, strings=may_hold_lone_surrogate(text))
    except OutputInvalid as e:
        return None, CodeErrorInfo(code=ErrorCode.CODE_OUTPUT_INVALID, message=str(e))
    except (ValueError, TypeError, RecursionError) as e:
        return None, CodeErrorInfo(
            code=ErrorCode.CODE_OUTPUT_INVALID,
            message=f"The output could not be stored as JSON ({type(e).__name__}: "
            f"{safe_text(str(e), 500)}): return dicts, lists, strings, finite numbers, "
            "booleans or None.",
        )
    return text, None


def _dumps_strict(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def _load_output(text: str) -> Any:
    """A stored output, renderable whatever an older version stored (lone surrogates become
    U+FFFD; a text too deep to read is reported, not raised)."""
    try:
        return safe_value(json.loads(text))
    except (RecursionError, ValueError):
        return {"unreadable_output": "The stored output is nested too deep or is not JSON."}


def _load_error(text: str) -> CodeErrorInfo:
    data = json.loads(text)
    return CodeErrorInfo(code=data["code"], message=safe_text(str(data.get("message", ""))))


def normalize_url(url: str | URL) -> URL:
    """``postgres://`` and ``postgresql://`` mean psycopg 3 (psycopg2 is not installed)."""
    u = make_url(url)
    if u.drivername in ("postgres", "postgresql"):
        u = u.set(drivername="postgresql+psycopg")
    return u


def _sqlite_file(u: URL) -> Path | None:
    db = u.database
    if not db or db == ":memory:" or db.startswith("file:") or u.query.get("mode") == "memory":
        return None
    return Path(db).expanduser()


def describe_url(url: str | URL) -> str:
    """``url`` as logs and errors show it: the password hidden."""
    try:
        return normalize_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a URL at all: show nothing secret
        return "<a run store URL that cannot be parsed>"


def _record(row: Any, inputs: Any | None = None) -> JobRecord:
    """The record of a ``code_jobs`` row (``_JOB_COLUMNS``: SQLAlchemy's ``Row``, or the
    lane's row that reads the same way); ``inputs``: its code and state (its
    ``code_job_inputs`` row), None when not read or not there ("" and "{}")."""
    try:
        return _record_strict(row, inputs)
    except Exception:  # noqa: BLE001 - one bad value must not make the row unreadable
        return _record_tolerant(row, inputs)


#: the inputs' columns: in ``job_inputs``; in ``code_jobs`` too, never read from there
_INPUTS = ("code", "state_json")
#: the columns of ``code_jobs`` that are fields of JobRecord, in the table's order (neither
#: started_ts nor the inputs): both readers below go over them, so a column added to the
#: table and the record is read without another line here
_RECORD_COLUMNS = tuple(
    c.name for c in jobs.columns if c.name in JobRecord.model_fields and c.name not in _INPUTS
)


_INSERT_INPUTS = insert(job_inputs)


def _p(name: str, type_: Any) -> Any:
    """A named parameter of a statement built once (``_CLAIM``, ``_FINISH``)."""
    return bindparam(name, type_=type_)


#: queued -> running (or running -> running: a redelivery); parameters c_id, c_at, c_ts, c_by
_CLAIM = (
    update(jobs)
    .where(
        jobs.c.job_id == _p("c_id", String),
        jobs.c.status.in_([Status.QUEUED.value, Status.RUNNING.value]),
    )
    .values(
        status=Status.RUNNING.value,
        started_at=_p("c_at", UtcDateTime),
        started_ts=_p("c_ts", Double),
        worker=_p("c_by", String),
        attempts=jobs.c.attempts + 1,
    )
)

#: ``code_jobs`` without the inputs' columns (see ``job_inputs``)
_JOB_COLUMNS = tuple(c for c in jobs.columns if c.name not in _INPUTS)

_CLAIM_RETURNING = _CLAIM.returning(*_JOB_COLUMNS)
_SELECT_JOB = select(*_JOB_COLUMNS).where(jobs.c.job_id == _p("r_id", String))

_CANCELLING = jobs.c.status == Status.CANCELLING.value
#: the result, once, on an open job; a job cancelled while it ran ends cancelled whatever it
#: returned (its logs, duration and trace are kept, its output is not). Parameters f_*.
_FINISH = (
    update(jobs)
    .where(
        jobs.c.job_id == _p("f_id", String),
        jobs.c.status.in_([s.value for s in OPEN_STATUSES]),
    )
    .values(
        status=case(
            (_CANCELLING, literal(Status.CANCELLED.value, String)), else_=_p("f_status", String)
        ),
        error=case(
            (_CANCELLING, literal(_error_json(CANCELLED_WHILE_RUNNING), SafeText)),
            else_=_p("f_error", SafeText),
        ),
        output=case((_CANCELLING, literal(None, SafeText)), else_=_p("f_output", SafeText)),
        logs=_p("f_logs", SafeText),
        logs_truncated=_p("f_logs_truncated", Boolean),
        warnings=_p("f_warnings", SafeText),
        trace=_p("f_trace", SafeText),
        exit_code=_p("f_exit_code", Integer),
        duration_ms=_p("f_duration_ms", Double),
        usage=_p("f_usage", SafeText),
        runtime=_p("f_runtime", String),
        code_runtime=_p("f_code_runtime", String),
        finished_at=_p("f_finished_at", UtcDateTime),
        worker=_p("f_worker", String),
    )
)
#: the row as written: the finished record goes out with the job's done notice, so a waiter
#: does not read it back
_FINISH_RETURNING = _FINISH.returning(*_JOB_COLUMNS)


def _columns_of(type_: type) -> frozenset[str]:
    return frozenset(c.name for c in jobs.columns if isinstance(c.type, type_))


def _fast_lane(engine: Engine) -> FastLane | None:
    """create / claim / finish as plain DBAPI statements (executor.store.fast), the same
    statements as ``_CLAIM_RETURNING`` and ``_FINISH_RETURNING`` with the same conversions
    as the column types here; None where the engine cannot take them."""
    return lane_for(
        engine,
        columns=tuple(c.name for c in _JOB_COLUMNS),
        times=_columns_of(UtcDateTime),
        bools=_columns_of(Boolean),
        texts=_columns_of(SafeText)
        | frozenset(c.name for c in job_inputs.columns if isinstance(c.type, SafeText)),
        open_statuses=tuple(s.value for s in OPEN_STATUSES),
        cancelled_while_running=_error_json(CANCELLED_WHILE_RUNNING),
    )


def _select_jobs(*, inputs: bool) -> Any:
    """SELECT of whole records; without ``inputs``, code and state are not read (the record
    holds "" and "{}"); with them, from ``job_inputs`` (NULL: the job has no row there).
    (One job's record is read in two statements instead, ``_read_inputs``.)"""
    if not inputs:
        return select(*_JOB_COLUMNS)
    joined = jobs.outerjoin(job_inputs, job_inputs.c.job_id == jobs.c.job_id)
    return select(
        *_JOB_COLUMNS,
        job_inputs.c.job_id.label("inputs_of"),
        job_inputs.c.code,
        job_inputs.c.state_json,
    ).select_from(joined)


def _joined_inputs(row: Row[Any]) -> Row[Any] | None:
    """The inputs of a ``_select_jobs(inputs=True)`` row: the row itself, if the job has them."""
    return row if row._mapping["inputs_of"] is not None else None


#: one job's inputs and one job's row: built once, executed with the id as a parameter (a
#: statement built per call costs its cache-key walk every time, about as much as running it)
_SELECT_INPUTS = select(job_inputs.c.code, job_inputs.c.state_json).where(
    job_inputs.c.job_id == _p("r_id", String)
)


def _read_inputs(conn: Connection, job_id: str) -> Any:
    """The ``code_job_inputs`` row of ``job_id`` (None: retention removed it)."""
    return conn.execute(_SELECT_INPUTS, {"r_id": job_id}).first()


def _record_strict(row: Row[Any], inputs: Row[Any] | None = None) -> JobRecord:
    m = row._mapping
    fields = {name: m[name] for name in _RECORD_COLUMNS}
    if inputs is not None:
        fields.update(code=inputs.code, state_json=inputs.state_json)
    fields.update(
        status=Status(m["status"]),
        output=None if m["output"] is None else _load_output(m["output"]),
        error=None if m["error"] is None else _load_error(m["error"]),
        logs_truncated=bool(m["logs_truncated"]),
        warnings=json.loads(m["warnings"]),
        trace=[TraceRow.model_validate(t) for t in json.loads(m["trace"])],
        usage=_usage_of(m["usage"]),
    )
    return JobRecord(**fields)


def _usage_of(v: Any) -> Usage | None:
    return None if v is None else Usage.model_validate_json(v)


def _raw(row: Row[Any], name: str) -> Any:
    """A column's value, or an exception when the driver cannot even convert it (e.g. a
    malformed date in SQLite)."""
    try:
        return row._mapping[name]
    except Exception as e:  # noqa: BLE001
        return e


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


#: what each column must hold, as the sentence of an unreadable row says it
_ALLOWED = {
    "status": "a status (" + ", ".join(s.value for s in Status) + ")",
    "kind": "'run' or 'test'",
    "user": "text",
    "language": "a language this worker knows (python, typescript)",
    "code": "text",
    "state_json": "text",
    "timeout_s": "a number of seconds",
    "code_runtime": "text",
    "runtime": "text",
    "output": "JSON",
    "error": "an error object ({code, message})",
    "logs": "text",
    "logs_truncated": "true or false",
    "warnings": "a JSON list of text",
    "trace": "a JSON list of trace rows",
    "exit_code": "an integer",
    "duration_ms": "a number",
    "queued_at": "a time",
    "started_at": "a time",
    "finished_at": "a time",
    "worker": "text",
    "attempts": "an integer",
    "pruned_at": "a time",
    "memory_bytes": "a number of bytes",
    "cpus": "a CPU share",
    "usage": "a usage object ({memory_peak_bytes, cpu_ms, pids_peak, source})",
}
#: an unreadable column's value where the record has no default of its own
_TOLERANT_DEFAULTS: dict[str, Any] = {
    "status": Status.FAILED,
    "queued_at": datetime.fromtimestamp(0, UTC),
}


def _record_tolerant(row: Row[Any], inputs: Row[Any] | None = None) -> JobRecord:
    """The row field by field: a column that cannot be read gets its default and a sentence
    in ``problems``, so the job can still be shown and ended."""
    problems: list[str] = []
    fields: dict[str, Any] = {}

    def take(name: str, parse: Any, default: Any, allowed: str) -> None:
        value = _raw(inputs if name in _INPUTS and inputs is not None else row, name)
        try:
            if isinstance(value, Exception):
                raise value
            parsed = parse(value)
            JobRecord.model_validate(
                {"job_id": "x", "status": "failed", "queued_at": datetime.now(UTC), name: parsed}
            )
            fields[name] = parsed
        except Exception:  # noqa: BLE001
            shown = "unreadable" if isinstance(value, Exception) else _short(value)
            problems.append(f"{name}={shown} is not {allowed}")
            fields[name] = default

    def same(v: Any) -> Any:
        return v

    def json_or_none(v: Any) -> Any:
        return None if v is None else json.loads(v)

    def error_of(v: Any) -> Any:
        return None if v is None else CodeErrorInfo.model_validate_json(v)

    def trace_of(v: Any) -> Any:
        return [TraceRow.model_validate(t) for t in json.loads(v)]

    parse = {
        "status": Status,
        "output": json_or_none,
        "error": error_of,
        "logs_truncated": bool,
        "warnings": json.loads,
        "trace": trace_of,
        "usage": _usage_of,
    }
    job_id = _raw(row, "job_id")
    fields["job_id"] = str(job_id) if not isinstance(job_id, Exception) else "?"
    for name in _RECORD_COLUMNS + (_INPUTS if inputs is not None else ()):
        if name == "job_id":
            continue
        own = JobRecord.model_fields[name].get_default(call_default_factory=True)
        take(
            name,
            parse.get(name, same),
            _TOLERANT_DEFAULTS.get(name, own),
            _ALLOWED.get(name, "readable"),
        )
    if problems and fields.get("error") is None:
        fields["error"] = CodeErrorInfo(
            code=ErrorCode.RUNTIME_UNAVAILABLE,
            message="The run store's row of this job cannot be read: " + "; ".join(problems) + ".",
        )
    return JobRecord(**fields, problems=problems)


#: the columns a run-history row carries (no code, state, output, logs, trace): RunSummary's
_SUMMARY_COLUMNS = tuple(jobs.c[name] for name in RunSummary.model_fields)
_SELECT_SUMMARY = select(*_SUMMARY_COLUMNS).where(jobs.c.job_id == _p("r_id", String))
_SELECT_STATUS = select(jobs.c.status).where(jobs.c.job_id == _p("r_id", String))


def _summary(row: Any) -> RunSummary:
    m = row._mapping
    fields = {name: m[name] for name in RunSummary.model_fields}
    fields.update(
        status=Status(m["status"]),
        error=None if m["error"] is None else CodeErrorInfo.model_validate_json(m["error"]),
        usage=_usage_of(m["usage"]),
    )
    return RunSummary(**fields)


def _no_such_table(e: exc.DBAPIError) -> bool:
    """``e`` says a table is missing (SQLite's message; PostgreSQL's SQLSTATE 42P01)."""
    return getattr(e.orig, "sqlstate", None) == "42P01" or "no such table" in str(e.orig)


# --- the store ---------------------------------------------------------------------------


@raise_store_outages
class SqlRunStore(RunStore):
    """The run store in a SQL database reached through ``url`` (any SQLAlchemy URL; tested
    on SQLite files and PostgreSQL via psycopg 3). Brings its schema to this release's
    (``executor.store.migrations``) when it opens, unless ``create_tables`` is False: then
    it creates and changes nothing.

    One instance per process: it holds a connection pool. A connection opened before a
    fork is never reused by the child (it opens its own)."""

    def __init__(self, url: str | URL, *, create_tables: bool = True) -> None:
        self.url = normalize_url(url)
        if not create_tables:
            path = _sqlite_file(self.url) if self.url.get_backend_name() == "sqlite" else None
            if path is not None and not path.exists():
                # Opening it would create it (and reading needs no new folder or file).
                raise StoreUnavailable(
                    f"There is no run store at {self.describe()} (no such file): nothing "
                    "was ever submitted to it. Point STUDIO_DATABASE_URL (or "
                    "STUDIO_DATA_DIR) at the store the API and the workers use."
                )
        self._engine = self._make_engine(self.url, create=create_tables)
        self._checkpoints = (
            _Checkpointer(self._engine)
            if self.url.get_backend_name() == "sqlite" and _sqlite_file(self.url) is not None
            else None
        )
        self._closed = False
        self._store_id: str | None = None
        self._insert_job: Any = None
        #: the job path's three writes off SQLAlchemy's execution layer (None: not here)
        self._lane = _fast_lane(self._engine)
        #: the migration steps this open applied (``migrations.upgrade``); () at HEAD
        self.schema_steps: tuple[str, ...] = ()
        try:
            if create_tables:
                self._open_schema()
        except BaseException:
            with self._gate():
                self._engine.dispose()
            raise

    # engine & transactions ------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def dialect(self) -> str:
        return self._engine.dialect.name

    @staticmethod
    def _make_engine(u: URL, *, create: bool = True) -> Engine:
        if u.get_backend_name() == "sqlite":
            path = _sqlite_file(u)
            if path is not None:
                if create:
                    path.parent.mkdir(parents=True, exist_ok=True)
                engine = create_engine(u)
            else:  # in memory: one shared connection, or every checkout sees an empty db
                engine = create_engine(
                    u, poolclass=StaticPool, connect_args={"check_same_thread": False}
                )
            _configure_sqlite(engine)
        else:
            engine = create_engine(u, pool_pre_ping=True)
        _guard_against_fork(engine)
        return engine

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        with self._wrote(), self._engine.begin() as conn:
            yield conn

    @contextmanager
    def _wrote(self) -> Iterator[None]:
        """Around a write of this process (SQLAlchemy's or the lane's): the fork gate while
        it runs, the checkpointer told once it is committed."""
        with self._gate():
            yield
        if self._checkpoints is not None:
            self._checkpoints.wrote()

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        with self._gate(), self._engine.connect() as conn:
            conn.execution_options(**{_READ_ONLY: True})
            with conn.begin():
                yield conn

    def _gate(self) -> AbstractContextManager[None]:
        """SQLite: no fork of this process while the call runs (``_ForkGate``)."""
        return _FORK_GATE.held() if self.dialect == "sqlite" else nullcontext()

    def _open_schema(self) -> None:
        """The schema at this release's HEAD and the store's id known. At HEAD (or at a
        newer release's revision) that is one read; else the migrations run under the
        schema lock: the advisory lock on PostgreSQL, BEGIN IMMEDIATE on SQLite (many
        workers may start at once; of their opens, one applies the revisions)."""
        at, self._store_id = self._schema_version()
        if self._store_id and at is not None:
            if at == migrations.head():
                return
            if at not in migrations.revisions():
                log.info(
                    "run store %s is at schema revision %s, newer than this release's %s: "
                    "used as it is (a newer release upgraded it)",
                    self.describe(),
                    at,
                    migrations.head(),
                )
                return
        with self._write() as conn:
            if self.dialect == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_SCHEMA_LOCK})
            self.schema_steps = migrations.upgrade(conn)
            self._store_id = self._read_store_id(conn)
            if self._store_id is None:
                self._store_id = uuid.uuid4().hex
                conn.execute(insert(store_meta).values(key=_STORE_ID, value=self._store_id))
        if self.schema_steps:
            log.info(
                "run store %s: schema brought to revision %s (%s)",
                self.describe(),
                migrations.head(),
                ", ".join(self.schema_steps),
            )

    def _schema_version(self) -> tuple[str | None, str | None]:
        """(the store's schema revision, its id) in one statement; (None, None) when it
        has no version table (a new store, or one made before migrations)."""
        version = f"SELECT version_num FROM {migrations.VERSION_TABLE}"
        store_id = select(store_meta.c.value).where(store_meta.c.key == _STORE_ID)
        both = select(literal_column(f"({version})"), store_id.scalar_subquery())
        try:
            with self._read() as conn:
                row = conn.execute(both).one()
        except (exc.OperationalError, exc.ProgrammingError) as e:
            if not _no_such_table(e):
                raise
            return None, None
        return row[0], row[1]

    @staticmethod
    def _read_store_id(conn: Connection) -> str | None:
        return conn.execute(
            select(store_meta.c.value).where(store_meta.c.key == _STORE_ID)
        ).scalar_one_or_none()

    @property
    def store_id(self) -> str:
        if self._store_id is None:
            try:
                with self._read() as conn:
                    self._store_id = self._read_store_id(conn) or ""
            except exc.ProgrammingError:  # a store made before ids existed, opened read-only
                self._store_id = ""
            except exc.OperationalError as e:
                if "no such table" not in str(e):
                    raise
                self._store_id = ""
        return self._store_id

    def describe(self) -> str:
        return describe_url(self.url)

    # RunStore ---------------------------------------------------------------------------

    def create(self, job: CodeJob, *, code_runtime: str) -> bool:
        values = {
            **job.model_dump(exclude={"code", "state_json"}),  # fields = columns by name
            "code": "",  # in job_inputs (see there)
            "state_json": "{}",
            "status": Status.QUEUED.value,
            "code_runtime": code_runtime,
            "logs": "",
            "logs_truncated": False,
            "warnings": "[]",
            "trace": "[]",
            "queued_at": _utcnow(),
            "attempts": 0,
        }
        inputs = {"job_id": job.job_id, "code": _storable(job.code), "state_json": job.state_json}
        if self._lane is not None:
            with self._wrote():
                return self._lane.create(values, inputs)
        # Statements built once per store, executed with the values as parameters: building
        # them per call with .values() cost more than running them.
        if self._insert_job is None:
            stmt: Any = insert(jobs)
            if self.dialect in ("sqlite", "postgresql"):
                dialect_insert = sqlite_insert if self.dialect == "sqlite" else pg_insert
                stmt = dialect_insert(jobs).on_conflict_do_nothing(index_elements=[jobs.c.job_id])
                if self._engine.dialect.insert_returning:
                    # rowcount of an INSERT is not reliable (-1 with psycopg); RETURNING is.
                    stmt = stmt.returning(jobs.c.job_id)
            self._insert_job = stmt
        try:
            with self._write() as conn:
                done = conn.execute(self._insert_job, values)
                created = done.first() is not None if done.returns_rows else done.rowcount == 1
                if created:  # same transaction: both rows or neither
                    conn.execute(_INSERT_INPUTS, inputs)
                return created
        except exc.IntegrityError:  # a dialect with no ON CONFLICT: the row exists
            return False

    def get(self, job_id: str, *, inputs: bool = True) -> JobRecord | None:
        with self._read() as conn:
            row = conn.execute(_SELECT_JOB, {"r_id": job_id}).first()
            own = _read_inputs(conn, job_id) if inputs and row is not None else None
        return None if row is None else _record(row, own)

    def get_summary(self, job_id: str) -> RunSummary | None:
        with self._read() as conn:
            row = conn.execute(_SELECT_SUMMARY, {"r_id": job_id}).first()
        return None if row is None else _summary(row)

    def get_many(self, job_ids: Iterable[str], *, inputs: bool = True) -> dict[str, JobRecord]:
        ids = list(dict.fromkeys(job_ids))
        out: dict[str, JobRecord] = {}
        with self._read() as conn:
            for i in range(0, len(ids), _CHUNK):
                chunk = ids[i : i + _CHUNK]
                stmt = _select_jobs(inputs=inputs).where(jobs.c.job_id.in_(chunk))
                for row in conn.execute(stmt):
                    rec = _record(row, _joined_inputs(row) if inputs else None)
                    out[rec.job_id] = rec
        return out

    def statuses(self, job_ids: Iterable[str]) -> dict[str, Status]:
        ids = list(dict.fromkeys(job_ids))
        out: dict[str, Status] = {}
        with self._read() as conn:
            for i in range(0, len(ids), _CHUNK):
                rows = conn.execute(
                    select(jobs.c.job_id, jobs.c.status).where(
                        jobs.c.job_id.in_(ids[i : i + _CHUNK])
                    )
                )
                out.update({job_id: Status(status) for job_id, status in rows})
        return out

    def claim(self, job_id: str, worker: str) -> JobRecord | None:
        now = _utcnow()
        params = {"c_id": job_id, "c_at": now, "c_ts": now.timestamp(), "c_by": worker}
        if self._lane is not None:
            with self._wrote():
                claimed = self._lane.claim(params)
            return None if claimed is None else _record(*claimed)
        with self._write() as conn:
            if self._engine.dialect.update_returning:
                row = conn.execute(_CLAIM_RETURNING, params).first()  # the row as written
                if row is None:
                    return None
            else:
                if conn.execute(_CLAIM, params).rowcount != 1:
                    return None
                # Same transaction: the row is still locked by us, so this is what we wrote.
                row = conn.execute(_SELECT_JOB, {"r_id": job_id}).one()
            # Its code and state: a second statement, not a subquery in the RETURNING (SQLite
            # buffers what RETURNING yields: a 10 MB state was copied twice more).
            own = _read_inputs(conn, job_id)
        return _record(row, own)

    def request_cancel(self, job_id: str) -> Status | None:
        now = _utcnow()
        queued = jobs.c.status == Status.QUEUED.value
        stmt = (
            update(jobs)
            .where(
                jobs.c.job_id == job_id,
                jobs.c.status.in_([Status.QUEUED.value, Status.RUNNING.value]),
            )
            .values(
                status=case(
                    (queued, literal(Status.CANCELLED.value, String)),
                    else_=literal(Status.CANCELLING.value, String),
                ),
                finished_at=case((queued, literal(now, UtcDateTime)), else_=jobs.c.finished_at),
                error=case(
                    (queued, literal(_error_json(CANCELLED_BEFORE_START), SafeText)),
                    else_=jobs.c.error,
                ),
            )
        )
        with self._write() as conn:
            conn.execute(stmt)
            status = conn.execute(
                select(jobs.c.status).where(jobs.c.job_id == job_id)
            ).scalar_one_or_none()
        return None if status is None else Status(status)

    def is_cancel_requested(self, job_id: str) -> bool:
        with self._read() as conn:
            status = conn.execute(_SELECT_STATUS, {"r_id": job_id}).scalar_one_or_none()
        return status in (Status.CANCELLING.value, Status.CANCELLED.value)

    def finish(self, result: CodeResult, *, worker: str) -> bool:
        return self.finish_with_outcome(result, worker=worker) is not None

    def finish_with_outcome(self, result: CodeResult, *, worker: str) -> Ended | None:
        if not result.status.finished:
            raise ValueError(f"finish() needs a finished status, not {result.status.value!r}")
        data = result.model_dump(mode="json", include={"warnings", "trace"})
        output_json, refused = _output_json(result)
        status, error = result.status, result.error
        if refused is not None:
            status, error = Status.FAILED, refused
        params = {
            "f_id": result.job_id,
            "f_status": status.value,
            "f_error": _error_json(error),
            "f_output": output_json,
            "f_logs": _storable(result.logs),
            "f_logs_truncated": result.logs_truncated,
            "f_warnings": _dumps(data["warnings"]),  # the executor's own sentences
            "f_trace": _dumps(data["trace"]),
            "f_exit_code": result.exit_code,
            "f_duration_ms": result.duration_ms,
            "f_usage": result.usage.model_dump_json() if result.usage is not None else None,
            "f_runtime": result.runtime,
            "f_code_runtime": result.code_runtime,
            "f_finished_at": _utcnow(),
            "f_worker": worker,
        }
        if self._lane is not None:
            with self._wrote():
                row = self._lane.finish(params)
        else:
            row = self._finish_sa(params)
        if row is None:
            return None
        rec = _record(row)
        return Ended(rec.status, rec.error, rec)

    def _finish_sa(self, params: dict[str, Any]) -> Any:
        with self._write() as conn:
            if self._engine.dialect.update_returning:
                row = conn.execute(_FINISH_RETURNING, params).first()
            elif conn.execute(_FINISH, params).rowcount == 1:
                # same transaction: the row is still locked by us, so this is what we wrote
                row = conn.execute(_SELECT_JOB, {"r_id": params["f_id"]}).one()
            else:
                row = None
        return row

    def fail_stuck(
        self,
        older_than_s: float,
        reason: str = WORKER_STOPPED,
        *,
        default_timeout_s: float = 30.0,
        keep: Collection[str] = (),
    ) -> list[str]:
        now = _utcnow()
        deadline = (
            jobs.c.started_ts
            + func.coalesce(jobs.c.timeout_s, literal(float(default_timeout_s), Double))
            + literal(float(older_than_s), Double)
        )
        stuck = and_(
            jobs.c.status.in_([Status.RUNNING.value, Status.CANCELLING.value]),
            jobs.c.started_ts.is_not(None),
            deadline < literal(now.timestamp(), Double),
        )
        error = CodeErrorInfo(code=ErrorCode.RUNTIME_UNAVAILABLE, message=reason)
        values = {
            "status": case(
                (
                    jobs.c.status == Status.CANCELLING.value,
                    literal(Status.CANCELLED.value, String),
                ),
                else_=literal(Status.FAILED.value, String),
            ),
            "error": _error_json(error),
            "output": None,
            "finished_at": now,
        }
        if keep:
            # a job whose message is still in the broker is not stuck: it comes round again
            with self._read() as conn:
                candidates = conn.execute(select(jobs.c.job_id).where(stuck)).scalars().all()
            ids = [job_id for job_id in candidates if job_id not in keep]
            if not ids:
                return []
            stuck = and_(stuck, jobs.c.job_id.in_(ids[:_CHUNK]))
        if self._engine.dialect.update_returning:
            stmt = update(jobs).where(stuck).values(values).returning(jobs.c.job_id)
            with self._write() as conn:
                return sorted(conn.execute(stmt).scalars().all())
        # No UPDATE ... RETURNING: find candidates, then win each row with its own
        # conditional UPDATE (the condition is re-checked, so a racing finish() is safe).
        with self._read() as conn:
            candidates = conn.execute(select(jobs.c.job_id).where(stuck)).scalars().all()
        changed = []
        for job_id in candidates:
            with self._write() as conn:
                one = update(jobs).where(jobs.c.job_id == job_id, stuck).values(values)
                if conn.execute(one).rowcount == 1:
                    changed.append(job_id)
        return sorted(changed)

    def list_queued(
        self, older_than_s: float, *, kind: str | None = None, limit: int = 1000
    ) -> list[QueuedJob]:
        cutoff = datetime.fromtimestamp(_utcnow().timestamp() - older_than_s, UTC)
        stmt = (
            select(jobs.c.job_id, jobs.c.kind, jobs.c.queued_at)
            .where(jobs.c.status == Status.QUEUED.value, jobs.c.queued_at < cutoff)
            .order_by(jobs.c.queued_at)
            .limit(max(0, int(limit)))
        )
        if kind is not None:
            stmt = stmt.where(jobs.c.kind == kind)
        with self._read() as conn:
            return [QueuedJob(r.job_id, r.kind, r.queued_at) for r in conn.execute(stmt)]

    def fail_queued(self, job_ids: Iterable[str], message: str) -> list[str]:
        ids = list(dict.fromkeys(job_ids))
        error = CodeErrorInfo(code=ErrorCode.RUNTIME_UNAVAILABLE, message=message)
        values = {
            "status": Status.FAILED.value,
            "error": _error_json(error),
            "output": None,
            "finished_at": _utcnow(),
        }
        changed: list[str] = []
        for i in range(0, len(ids), _CHUNK):
            chunk = ids[i : i + _CHUNK]
            still_queued = and_(jobs.c.job_id.in_(chunk), jobs.c.status == Status.QUEUED.value)
            with self._write() as conn:
                if self._engine.dialect.update_returning:
                    stmt = update(jobs).where(still_queued).values(values)
                    changed += conn.execute(stmt.returning(jobs.c.job_id)).scalars().all()
                    continue
                for job_id in conn.execute(select(jobs.c.job_id).where(still_queued)).scalars():
                    one = update(jobs).where(
                        jobs.c.job_id == job_id, jobs.c.status == Status.QUEUED.value
                    )
                    if conn.execute(one.values(values)).rowcount == 1:
                        changed.append(job_id)
        return sorted(changed)

    def audit(self, event: str, details: dict[str, Any], *, actor: str = "system") -> None:
        with self._write() as conn:
            conn.execute(
                insert(audit_log).values(
                    at=_utcnow(), event=event, actor=actor, details=_dumps(details)
                )
            )

    def list_audit(self, event: str | None = None, limit: int = 100) -> list[AuditEntry]:
        stmt = select(audit_log).order_by(audit_log.c.id.desc()).limit(max(0, int(limit)))
        if event is not None:
            stmt = stmt.where(audit_log.c.event == event)
        with self._read() as conn:
            rows = conn.execute(stmt).all()
        return [
            AuditEntry(
                id=r.id, at=r.at, event=r.event, actor=r.actor, details=json.loads(r.details)
            )
            for r in rows
        ]

    def list_runs(
        self, where: RunFilter, *, limit: int = 50, before: tuple[datetime, str] | None = None
    ) -> list[RunSummary]:
        stmt = select(*_SUMMARY_COLUMNS)
        if where.user is not None:
            stmt = stmt.where(jobs.c.user == where.user)
        if where.status:
            stmt = stmt.where(jobs.c.status.in_([s.value for s in where.status]))
        if where.language is not None:
            stmt = stmt.where(jobs.c.language == where.language)
        if where.code_runtime is not None:
            stmt = stmt.where(jobs.c.code_runtime == where.code_runtime)
        if where.kind is not None:
            stmt = stmt.where(jobs.c.kind == where.kind)
        if where.since is not None:
            stmt = stmt.where(jobs.c.queued_at >= where.since)
        if where.until is not None:
            stmt = stmt.where(jobs.c.queued_at < where.until)
        if before is not None:
            at, job_id = before
            # Written so both databases seek the (queued_at, job_id) index: a range on
            # queued_at, then the tie on job_id.
            stmt = stmt.where(
                jobs.c.queued_at <= at,
                (jobs.c.queued_at < at) | (jobs.c.job_id < job_id),
            )
        stmt = stmt.order_by(jobs.c.queued_at.desc(), jobs.c.job_id.desc()).limit(
            max(0, int(limit))
        )
        with self._read() as conn:
            return [_summary(r) for r in conn.execute(stmt)]

    def oldest_queued_at(self, kind: Kind | None = None) -> datetime | None:
        stmt = select(func.min(jobs.c.queued_at)).where(jobs.c.status == Status.QUEUED.value)
        if kind is not None:
            stmt = stmt.where(jobs.c.kind == kind)
        with self._read() as conn:
            value: datetime | None = conn.execute(stmt).scalar_one_or_none()
        return value

    def prune(
        self,
        *,
        runs_before: datetime | None,
        payloads_before: datetime | None,
        batch: int = 500,
        max_batches: int = 20,
    ) -> PruneReport:
        batch = max(1, int(batch))
        finished = [s.value for s in FINISHED]
        report = PruneReport()

        def run_batches(pick: Any, change: Any) -> int:
            """Bounded passes: the ids ``pick`` selects (at most ``batch``), their code and
            state (job_inputs) removed and ``change(ids)`` applied, in one transaction."""
            total = 0
            while report.batches < max_batches:
                with self._write() as conn:
                    ids = list(conn.execute(pick.limit(batch)).scalars())
                    if ids:
                        conn.execute(delete(job_inputs).where(job_inputs.c.job_id.in_(ids)))
                        conn.execute(change(jobs.c.job_id.in_(ids)))
                n = len(ids)
                report.batches += 1
                report.max_batch_rows = max(report.max_batch_rows, n)
                total += n
                if n < batch:
                    break
            return total

        if runs_before is not None:
            report.deleted = run_batches(
                select(jobs.c.job_id).where(
                    jobs.c.finished_at < runs_before, jobs.c.status.in_(finished)
                ),
                lambda these: delete(jobs).where(these),
            )
        if payloads_before is not None:
            report.payloads_cleared = run_batches(
                select(jobs.c.job_id).where(
                    jobs.c.pruned_at.is_(None),
                    jobs.c.finished_at < payloads_before,
                    jobs.c.status.in_(finished),
                ),
                lambda these: (
                    update(jobs)
                    .where(these)
                    .values(code="", state_json="{}", output=None, logs="", pruned_at=_utcnow())
                ),
            )
        if (report.deleted or report.payloads_cleared) and self.dialect == "sqlite":
            self._give_space_back()
        return report

    def _give_space_back(self) -> None:
        """SQLite: free pages go back to the file system (a store created by this release
        has auto_vacuum=INCREMENTAL; an older file keeps them for reuse) and the WAL is
        checkpointed and truncated. Both run outside a transaction; a busy reader only makes
        the checkpoint partial, never an error."""
        with self._gate():
            raw = self._engine.raw_connection()
            try:
                cur = raw.cursor()
                # executescript steps the pragma to its end; execute() frees one page only.
                # The pages freed are those this bounded pass deleted, so this stays short.
                cur.executescript("PRAGMA incremental_vacuum;")
                # (busy, frames, checkpointed): busy when another checkpoint runs at that moment
                # (a process's _Checkpointer): it is short, so try again a few times.
                for _ in range(20):
                    busy = cur.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()[0][0]
                    if not busy:
                        break
                    time.sleep(0.1)
                cur.close()
            except sqlite3.OperationalError as e:
                log.warning("SQLite space not given back this time: %s", e)
            finally:
                raw.close()

    def counts_by_status(self) -> dict[str, int]:
        stmt = select(jobs.c.status, func.count()).group_by(jobs.c.status)
        counts = {s.value: 0 for s in Status}
        with self._read() as conn:
            for status, n in conn.execute(stmt):
                counts[status] = int(n)
        return counts

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._checkpoints is not None:
                self._checkpoints.close()
            with self._gate():  # the last connection to close checkpoints
                self._engine.dispose()

    def __repr__(self) -> str:
        return f"SqlRunStore({self.url.render_as_string(hide_password=True)!r})"


# --- engine events -----------------------------------------------------------------------


def _configure_sqlite(engine: Engine) -> None:
    """WAL + busy_timeout on every connection; SQLAlchemy (not sqlite3) emits BEGIN, IMMEDIATE
    for writes so concurrent writers queue on the lock instead of failing."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # sqlite3 must not emit its own BEGIN
        cur = dbapi_conn.cursor()
        try:
            cur.execute(f"PRAGMA busy_timeout = {_SQLITE_BUSY_TIMEOUT_MS}")
            # Only a NEW file takes it (before its first table): retention's deletes then
            # give pages back with PRAGMA incremental_vacuum. An existing file is unchanged,
            # so it is not even asked there: setting it waits for the write lock, and a
            # connection opened while another process holds that lock (a backup, an admin
            # shell) would wait out busy_timeout before its first read (a readiness probe,
            # a pool process's fresh connection).
            if cur.execute("PRAGMA page_count").fetchone()[0] == 0:
                cur.execute("PRAGMA auto_vacuum = INCREMENTAL")
            # In WAL mode, NORMAL syncs at checkpoints, not at every commit: a crash of any
            # process loses nothing and the file stays consistent; only a power cut may undo
            # the last commits (like Redis's appendfsync everysec beside it). It takes the
            # fsync off every queue hop (three writes per job).
            cur.execute("PRAGMA synchronous = NORMAL")
            # The copy of the WAL into the file (and its fsync) is not paid by a commit:
            # measured, a 10 MB state's INSERT took 119 ms with SQLite's default (every such
            # commit passed 1000 pages and checkpointed), 39 ms without. _Checkpointer does
            # it from a thread; this bound stays as the safety net if that thread lags.
            cur.execute(f"PRAGMA wal_autocheckpoint = {_SQLITE_AUTOCHECKPOINT_PAGES}")
            # Switching to WAL needs a moment of exclusive access; many processes opening a
            # new file at once can find it locked, so retry briefly (WAL then persists).
            for attempt in range(50):
                try:
                    mode = cur.execute("PRAGMA journal_mode").fetchone()[0]
                    if str(mode).lower() not in ("wal", "memory"):
                        cur.execute("PRAGMA journal_mode = WAL")
                    break
                except sqlite3.OperationalError as e:
                    if "locked" not in str(e) or attempt == 49:
                        raise
                    time.sleep(0.1)
        finally:
            cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        if conn.get_execution_options().get(_READ_ONLY):
            conn.exec_driver_sql("BEGIN")
        else:
            conn.exec_driver_sql("BEGIN IMMEDIATE")


class _ForkGate:
    """No fork while this process is inside an SQLite call. SQLite keeps its file locks in
    per-process memory: a child forked while the parent held a write transaction or ran a
    checkpoint inherits that lock as "held by another connection of this process", and every
    connection it opens then waits out busy_timeout and fails ("database is locked"), for
    the child's whole life (seen: Celery's prefork pool started beside the main process's
    first writes). So every store call holds the gate, and ``os.fork`` (registered below:
    Celery's pool, ``subprocess`` with a ``preexec_fn``) waits until no call is inside it and
    lets none start until the fork is done. A thread that forks from inside a call of its
    own does not wait for itself."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._busy = 0
        self._forking = False
        self._mine = threading.local()

    @contextmanager
    def held(self) -> Iterator[None]:
        depth = getattr(self._mine, "depth", 0)
        with self._cond:
            while self._forking and depth == 0:
                self._cond.wait()
            self._busy += 1
        self._mine.depth = depth + 1
        try:
            yield
        finally:
            self._mine.depth = depth
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()

    def before_fork(self) -> None:
        own = getattr(self._mine, "depth", 0)
        self._cond.acquire()
        self._forking = True
        deadline = time.monotonic() + _FORK_WAIT_S
        while self._busy > own and (left := deadline - time.monotonic()) > 0:
            self._cond.wait(left)
        # forks with the lock held: no call starts or ends until after_in_parent

    def after_in_parent(self) -> None:
        self._forking = False
        self._cond.notify_all()
        self._cond.release()

    def after_in_child(self) -> None:
        self.__init__()  # type: ignore[misc]  # the parent's calls are not the child's


def no_fork_inside() -> AbstractContextManager[None]:
    """Hold it around SQLite work done outside the store (a raw ``sqlite3`` connection): this
    process does not fork while it runs (``_ForkGate``)."""
    return _FORK_GATE.held()


#: a fork waits at most this long for the calls in flight (a call is one transaction, bounded
#: by busy_timeout; past this, the fork goes ahead as it did before the gate)
_FORK_WAIT_S = 60.0
_FORK_GATE = _ForkGate()
os.register_at_fork(
    before=_FORK_GATE.before_fork,
    after_in_parent=_FORK_GATE.after_in_parent,
    after_in_child=_FORK_GATE.after_in_child,
)


class _Checkpointer:
    """SQLite: copies the WAL into the database file (``PRAGMA wal_checkpoint(PASSIVE)``)
    from a thread of this process, ``_SQLITE_CHECKPOINT_AFTER_S`` after it wrote, instead
    of in the commit that made the WAL long (see ``_SQLITE_AUTOCHECKPOINT_PAGES``). PASSIVE
    never waits for readers or writers; what it cannot copy now, the next pass does (any
    process's: a checkpoint copies every process's commits). The last connection to close
    the file checkpoints too (SQLite's own rule). A forked child starts its own thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._pid: int | None = None
        self._due = threading.Event()
        self._stop = False

    def wrote(self) -> None:
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._due = threading.Event()
            threading.Thread(target=self._loop, name="studio-sqlite-wal", daemon=True).start()
        self._due.set()

    def close(self) -> None:
        self._stop = True
        self._due.set()

    def _loop(self) -> None:
        pid, due = os.getpid(), self._due
        while True:
            due.wait()
            if self._stop or self._pid != pid:
                return
            time.sleep(_SQLITE_CHECKPOINT_AFTER_S)  # commits that come meanwhile: one pass
            due.clear()
            try:
                with _FORK_GATE.held():
                    raw = self.engine.raw_connection()
                    try:
                        cur = raw.cursor()
                        busy, frames, copied = cur.execute(
                            "PRAGMA wal_checkpoint(PASSIVE)"
                        ).fetchone()
                        if busy == 0 and frames > 0 and copied == frames:
                            _restart_wal(cur)
                        cur.close()
                    finally:
                        raw.close()
            except Exception as e:  # noqa: BLE001 - the next pass (or a commit) does it
                log.debug("SQLite WAL checkpoint skipped: %s", e)


def _restart_wal(cur: Any) -> None:
    """After a checkpoint that copied the whole WAL, the next write starts the WAL over and,
    with synchronous=NORMAL, syncs its new header first (fdatasync): measured, ~0.5-1 ms on
    the first write after each checkpoint, which at a few jobs a second is nearly every
    job's create or claim. One write here takes that turn instead, off the jobs' path: page
    1 written with what it holds (``user_version`` set to its own value: nothing visible
    changes; an UPDATE to the same value writes no page). A job's write that comes first
    pays it as before, and this one then appends a frame."""
    cur.execute("BEGIN IMMEDIATE")
    try:
        (version,) = cur.execute("PRAGMA user_version").fetchone()
        cur.execute(f"PRAGMA user_version = {int(version)}")
        cur.execute("COMMIT")
    except BaseException:
        cur.execute("ROLLBACK")
        raise


def _guard_against_fork(engine: Engine) -> None:
    """A pooled connection opened in a parent is never used (nor closed) by a forked child:
    SQLAlchemy's documented recipe (Celery prefork workers fork after import)."""

    @event.listens_for(engine, "connect")
    def _remember_pid(_dbapi_conn: Any, record: Any) -> None:
        record.info["pid"] = os.getpid()

    @event.listens_for(engine, "checkout")
    def _check_pid(_dbapi_conn: Any, record: Any, proxy: Any) -> None:
        if record.info.get("pid") != os.getpid():
            record.dbapi_connection = proxy.dbapi_connection = None
            raise exc.DisconnectionError(
                f"connection opened by process {record.info.get('pid')}, now in {os.getpid()}"
            )
