"""The run store on SQLAlchemy Core: a SQLite file by default, PostgreSQL for many machines.

Concurrency rules (see base.py): every state change is one conditional UPDATE whose rowcount
says whether this caller won. On PostgreSQL (READ COMMITTED) a concurrent UPDATE of the same
row waits for the row lock and re-checks the WHERE clause against the committed row, so only
one of two racing writers matches. On SQLite every write transaction starts with
``BEGIN IMMEDIATE`` (the database write lock is taken up front and waited for with
busy_timeout), so writers are serialised and never hit SQLite's lock-upgrade deadlock; reads
use a plain deferred ``BEGIN`` and, with WAL, never block or wait for writers.

The schema (``schema.py``) is brought to this release's by migrations
(``executor/store/migrations``) when a store opens. Beside this module: ``rows.py`` (a row as
a record), ``statements.py`` (the job path's statements), ``sqlite.py`` (SQLite's PRAGMAs,
fork gate and checkpointer) and ``fast.py`` (the job path's writes on the DBAPI).
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Collection, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    Connection,
    Double,
    Engine,
    String,
    and_,
    case,
    create_engine,
    delete,
    event,
    exc,
    func,
    insert,
    literal,
    literal_column,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import StaticPool

from executor.errors import ErrorCode, StoreUnavailable
from executor.keys import check_key
from executor.models import (
    FINISHED,
    Attempt,
    CodeErrorInfo,
    CodeJob,
    CodeResult,
    Kind,
    Status,
)
from executor.store import migrations, rows, sqlite
from executor.store import statements as st
from executor.store.base import (
    CANCELLED_BEFORE_START,
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
)
from executor.store.fast import lane_for
from executor.store.guard import raise_store_outages
from executor.store.schema import (
    STORE_ID,
    SafeText,
    UtcDateTime,
    audit_log,
    idempotency,
    job_inputs,
    jobs,
    store_meta,
)

log = logging.getLogger("studio_code.store")

#: pg_advisory_xact_lock key serialising schema changes at open (the releases before
#: migrations take the same one around their create_all: a rolling upgrade is serialised too)
_PG_SCHEMA_LOCK = 0x5374_7564_696F
_CHUNK = 500  # ids per IN (...) in get_many


# --- helpers -----------------------------------------------------------------------------


def _utcnow() -> datetime:
    return datetime.now(UTC)


def normalize_url(url: str | URL) -> URL:
    """``postgres://`` and ``postgresql://`` mean psycopg 3 (psycopg2 is not installed)."""
    u = make_url(url)
    if u.drivername in ("postgres", "postgresql"):
        u = u.set(drivername="postgresql+psycopg")
    return u


def describe_url(url: str | URL) -> str:
    """``url`` as logs and errors show it: the password hidden."""
    try:
        return normalize_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a URL at all: show nothing secret
        return "<a run store URL that cannot be parsed>"


def _unclaimed(found: Any) -> Claim:
    """Why a claim took nothing, from the row as it found it (``SELECT_UNCLAIMED``; None:
    no such job)."""
    if found is None:
        return Claim(None)
    return Claim(None, Status(found.status), found.started_at is not None)


def _read_inputs(conn: Connection, job_id: str) -> Any:
    """The ``code_job_inputs`` row of ``job_id`` (None: retention removed it)."""
    return conn.execute(st.SELECT_INPUTS, {"r_id": job_id}).first()


def _live(key_row: Any, now: datetime) -> bool:
    """An idempotency key's row (``st.SELECT_KEY``) still names its job: not expired, and
    the job's row is there."""
    return bool(key_row.expires_at > now and key_row.live_job is not None)


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
            path = sqlite.sqlite_file(self.url) if self.url.get_backend_name() == "sqlite" else None
            if path is not None and not path.exists():
                # Opening it would create it (and reading needs no new folder or file).
                raise StoreUnavailable(
                    f"There is no run store at {self.describe()} (no such file): nothing "
                    "was ever submitted to it. Point STUDIO_DATABASE_URL (or "
                    "STUDIO_DATA_DIR) at the store the API and the workers use."
                )
        self._engine = self._make_engine(self.url, create=create_tables)
        self._checkpoints = (
            sqlite.Checkpointer(self._engine)
            if self.url.get_backend_name() == "sqlite" and sqlite.sqlite_file(self.url) is not None
            else None
        )
        self._closed = False
        self._store_id: str | None = None
        self._insert_job: Any = None
        #: the job path's three writes off SQLAlchemy's execution layer (None: not here)
        self._lane = lane_for(self._engine)
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
            path = sqlite.sqlite_file(u)
            if path is not None:
                if create:
                    path.parent.mkdir(parents=True, exist_ok=True)
                engine = create_engine(u)
            else:  # in memory: one shared connection, or every checkout sees an empty db
                engine = create_engine(
                    u, poolclass=StaticPool, connect_args={"check_same_thread": False}
                )
            sqlite.configure(engine)
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
            conn.execution_options(**{sqlite.READ_ONLY: True})
            with conn.begin():
                yield conn

    def _gate(self) -> AbstractContextManager[None]:
        """SQLite: no fork of this process while the call runs (``sqlite.ForkGate``)."""
        return sqlite.FORK_GATE.held() if self.dialect == "sqlite" else nullcontext()

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
                conn.execute(insert(store_meta).values(key=STORE_ID, value=self._store_id))
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
        store_id = select(store_meta.c.value).where(store_meta.c.key == STORE_ID)
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
            select(store_meta.c.value).where(store_meta.c.key == STORE_ID)
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
        values, inputs = self._new_rows(job, code_runtime)
        if self._lane is not None:
            with self._wrote():
                return self._lane.create(values, inputs)
        try:
            with self._write() as conn:
                return self._insert_new(conn, values, inputs)
        except exc.IntegrityError:  # a dialect with no ON CONFLICT: the row exists
            return False

    def _insert_new(self, conn: Connection, values: dict[str, Any], inputs: dict[str, Any]) -> bool:
        """The job's row and its inputs' row, in ``conn``'s transaction: both or neither."""
        # Statements built once per store, executed with the values as parameters: building
        # them per call with .values() cost more than running them.
        if self._insert_job is None:
            self._insert_job = st.insert_job(self._engine.dialect)
        done = conn.execute(self._insert_job, values)
        created = done.first() is not None if done.returns_rows else done.rowcount == 1
        if created:
            conn.execute(st.INSERT_INPUTS, inputs)
        return bool(created)

    def create_keyed(
        self,
        job: CodeJob,
        *,
        code_runtime: str,
        key_hash: str,
        request_hash: str,
        expires_at: datetime,
    ) -> KeyedJob:
        values, inputs = self._new_rows(job, code_runtime)
        key = {"u": job.user, "k": key_hash}
        # Two tries: a concurrent repeat that inserted the key between this transaction's
        # read and its insert makes the insert fail on the primary key (PostgreSQL waits
        # for that transaction, then refuses); the second try reads its row. SQLite's
        # BEGIN IMMEDIATE serialises the two, so the first try always sees the other's row.
        for last in (False, True):
            try:
                with self._write() as conn:
                    now = _utcnow()
                    row = conn.execute(st.SELECT_KEY, key).first()
                    if row is not None:
                        if _live(row, now):
                            return KeyedJob(row.job_id, row.request_hash)
                        # expired, or its job was removed: that row only, as read. Never
                        # the key whatever it names: on PostgreSQL this statement sees rows
                        # committed since the read above, and a repeat's new key is live.
                        conn.execute(st.DELETE_STALE_KEY, {**key, "j": row.job_id})
                    conn.execute(
                        insert(idempotency),
                        {
                            "user": job.user,
                            "key_hash": key_hash,
                            "request_hash": request_hash,
                            "job_id": job.job_id,
                            "created_at": now,
                            "expires_at": expires_at,
                        },
                    )
                    self._insert_new(conn, values, inputs)
                    return KeyedJob(job.job_id, request_hash, created=True)
            except exc.IntegrityError:
                if last:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def find_key(self, user: str, key_hash: str) -> KeyedJob | None:
        with self._read() as conn:
            row = conn.execute(st.SELECT_KEY, {"u": user, "k": key_hash}).first()
        if row is None or not _live(row, _utcnow()):
            return None
        return KeyedJob(row.job_id, row.request_hash)

    @staticmethod
    def _new_rows(job: CodeJob, code_runtime: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """The ``code_jobs`` row of a new queued job, and its ``code_job_inputs`` row."""
        values = {
            # fields = columns
            **job.model_dump(exclude={"code", "state_json", "retry"}),
            # the concurrency keys as the submit checked them (NULL: none)
            "tenant": check_key("tenant", job.tenant) or None,
            "workflow": check_key("workflow", job.workflow) or None,
            "retry": None if job.retry is None else job.retry.model_dump_json(),
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
        inputs = {
            "job_id": job.job_id,
            "code": rows.storable(job.code),
            "state_json": job.state_json,
        }
        return values, inputs

    def get(self, job_id: str, *, inputs: bool = True) -> JobRecord | None:
        with self._read() as conn:
            row = conn.execute(st.SELECT_JOB, {"r_id": job_id}).first()
            own = _read_inputs(conn, job_id) if inputs and row is not None else None
        return None if row is None else rows.record(row, own)

    def get_summary(self, job_id: str) -> RunSummary | None:
        with self._read() as conn:
            row = conn.execute(st.SELECT_SUMMARY, {"r_id": job_id}).first()
        return None if row is None else rows.summary(row)

    def get_many(self, job_ids: Iterable[str], *, inputs: bool = True) -> dict[str, JobRecord]:
        ids = list(dict.fromkeys(job_ids))
        out: dict[str, JobRecord] = {}
        with self._read() as conn:
            for i in range(0, len(ids), _CHUNK):
                chunk = ids[i : i + _CHUNK]
                stmt = st.select_jobs(inputs=inputs).where(jobs.c.job_id.in_(chunk))
                for row in conn.execute(stmt):
                    rec = rows.record(row, st.joined_inputs(row) if inputs else None)
                    out[rec.job_id] = rec
        return out

    def statuses(self, job_ids: Iterable[str]) -> dict[str, Status]:
        ids = list(dict.fromkeys(job_ids))
        out: dict[str, Status] = {}
        with self._read() as conn:
            for i in range(0, len(ids), _CHUNK):
                found = conn.execute(
                    select(jobs.c.job_id, jobs.c.status).where(
                        jobs.c.job_id.in_(ids[i : i + _CHUNK])
                    )
                )
                out.update({job_id: Status(status) for job_id, status in found})
        return out

    def try_claim(self, job_id: str, worker: str, *, again: bool = True) -> Claim:
        now = _utcnow()
        params = {
            "c_id": job_id,
            "c_at": now,
            "c_ts": now.timestamp(),
            "c_by": worker,
            "c_again": Status.RUNNING.value if again else Status.QUEUED.value,
        }
        if self._lane is not None:
            with self._wrote():
                claimed, other = self._lane.claim(params)
            if claimed is None:
                return _unclaimed(other)
            return Claim(rows.record(claimed, other))
        with self._write() as conn:
            row = None
            if self._engine.dialect.update_returning:
                row = conn.execute(st.CLAIM_RETURNING, params).first()  # the row as written
            elif conn.execute(st.CLAIM, params).rowcount == 1:
                # Same transaction: the row is still locked by us, so this is what we wrote.
                row = conn.execute(st.SELECT_JOB, {"r_id": job_id}).one()
            if row is None:  # why not, in the same transaction
                return _unclaimed(conn.execute(st.SELECT_UNCLAIMED, {"r_id": job_id}).first())
            # Its code and state: a second statement, not a subquery in the RETURNING (SQLite
            # buffers what RETURNING yields: a 10 MB state was copied twice more).
            own = _read_inputs(conn, job_id)
        return Claim(rows.record(row, own))

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
                    (queued, literal(rows.error_json(CANCELLED_BEFORE_START), SafeText)),
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
            status = conn.execute(st.SELECT_STATUS, {"r_id": job_id}).scalar_one_or_none()
        return status in (Status.CANCELLING.value, Status.CANCELLED.value)

    def finish(self, result: CodeResult, *, worker: str) -> bool:
        return self.finish_with_outcome(result, worker=worker) is not None

    def finish_with_outcome(self, result: CodeResult, *, worker: str) -> Ended | None:
        if not result.status.finished:
            raise ValueError(f"finish() needs a finished status, not {result.status.value!r}")
        data = result.model_dump(mode="json", include={"warnings", "trace"})
        output_json, refused = rows.output_json(result)
        status, error = result.status, result.error
        if refused is not None:
            status, error = Status.FAILED, refused
        params = {
            "f_id": result.job_id,
            "f_status": status.value,
            "f_error": rows.error_json(error),
            "f_output": output_json,
            "f_logs": rows.storable(result.logs),
            "f_logs_truncated": result.logs_truncated,
            "f_warnings": rows.dumps(data["warnings"]),  # the executor's own sentences
            "f_trace": rows.dumps(data["trace"]),
            "f_exit_code": result.exit_code,
            "f_duration_ms": result.duration_ms,
            "f_usage": result.usage.model_dump_json() if result.usage is not None else None,
            "f_runtime": result.runtime,
            "f_code_runtime": result.code_runtime,
            "f_finished_at": _utcnow(),
            "f_worker": worker,
            "f_history": (
                rows.dumps([a.model_dump(mode="json") for a in result.history])
                if result.history
                else None
            ),
        }
        if self._lane is not None:
            with self._wrote():
                row = self._lane.finish(params)
        else:
            row = self._finish_sa(params)
        if row is None:
            return None
        rec = rows.record(row)
        return Ended(rec.status, rec.error, rec)

    def retry(
        self,
        job_id: str,
        worker: str,
        *,
        history: list[Attempt],
        not_before_ts: float,
        memory_bytes: int | None,
    ) -> bool:
        params = {
            "r_id": job_id,
            "r_by": worker,
            "r_nb": not_before_ts,
            "r_history": rows.dumps([a.model_dump(mode="json") for a in history]),
            "r_memory": memory_bytes,
        }
        with self._write() as conn:
            return bool(conn.execute(st.RETRY, params).rowcount == 1)

    def due_retries(self, *, limit: int = 500) -> list[QueuedJob]:
        params = {"now": _utcnow().timestamp(), "lim": max(0, int(limit))}
        with self._read() as conn:
            found = conn.execute(st.SELECT_DUE, params)
            return [rows.queued_job(r) for r in found]

    def mark_retry_sent(self, job_id: str) -> bool:
        with self._write() as conn:
            return bool(conn.execute(st.MARK_SENT, {"r_id": job_id}).rowcount == 1)

    def _finish_sa(self, params: dict[str, Any]) -> Any:
        with self._write() as conn:
            if self._engine.dialect.update_returning:
                row = conn.execute(st.FINISH_RETURNING, params).first()
            elif conn.execute(st.FINISH, params).rowcount == 1:
                # same transaction: the row is still locked by us, so this is what we wrote
                row = conn.execute(st.SELECT_JOB, {"r_id": params["f_id"]}).one()
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
            "error": rows.error_json(error),
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
        cutoff_ts = _utcnow().timestamp() - older_than_s
        cutoff = datetime.fromtimestamp(cutoff_ts, UTC)
        # a retry's attempt counts from when it was due (its not_before_ts), not from the
        # run's first queueing, and only once the retry sweep sent it (retry_sent): one
        # held by its delay, or due and not sent yet, is the retry sweep's
        # (worker.upkeep.retry_due), never sent twice by both
        waited = or_(
            and_(jobs.c.not_before_ts.is_(None), jobs.c.queued_at < cutoff),
            and_(jobs.c.retry_sent.is_(True), jobs.c.not_before_ts < cutoff_ts),
        )
        stmt = (
            select(*st.QUEUED_COLUMNS)
            .where(jobs.c.status == Status.QUEUED.value, waited)
            .order_by(jobs.c.queued_at)
            .limit(max(0, int(limit)))
        )
        if kind is not None:
            stmt = stmt.where(jobs.c.kind == kind)
        with self._read() as conn:
            return [rows.queued_job(r) for r in conn.execute(stmt)]

    def fail_queued(self, job_ids: Iterable[str], message: str) -> list[str]:
        ids = list(dict.fromkeys(job_ids))
        error = CodeErrorInfo(code=ErrorCode.RUNTIME_UNAVAILABLE, message=message)
        values = {
            "status": Status.FAILED.value,
            "error": rows.error_json(error),
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
                    at=_utcnow(), event=event, actor=actor, details=rows.dumps(details)
                )
            )

    def list_audit(self, event: str | None = None, limit: int = 100) -> list[AuditEntry]:
        stmt = select(audit_log).order_by(audit_log.c.id.desc()).limit(max(0, int(limit)))
        if event is not None:
            stmt = stmt.where(audit_log.c.event == event)
        with self._read() as conn:
            found = conn.execute(stmt).all()
        return [
            AuditEntry(
                id=r.id, at=r.at, event=r.event, actor=r.actor, details=json.loads(r.details)
            )
            for r in found
        ]

    def list_runs(
        self, where: RunFilter, *, limit: int = 50, before: tuple[datetime, str] | None = None
    ) -> list[RunSummary]:
        stmt = select(*st.SUMMARY_COLUMNS)
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
            return [rows.summary(r) for r in conn.execute(stmt)]

    def finished_since(self, kind: Kind, since: datetime) -> int:
        # ix_code_jobs_finished: the window's rows only
        stmt = (
            select(func.count())
            .select_from(jobs)
            .where(jobs.c.finished_at >= since, jobs.c.kind == kind)
        )
        with self._read() as conn:
            return int(conn.execute(stmt).scalar_one())

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
        keys_before: datetime | None = None,
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
        if keys_before is not None:
            with self._write() as conn:
                report.keys_removed = conn.execute(
                    delete(idempotency).where(idempotency.c.expires_at < keys_before)
                ).rowcount
        if (report.deleted or report.payloads_cleared) and self.dialect == "sqlite":
            sqlite.give_space_back(self._engine)
        return report

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
