"""The job path's statements, built once and executed with their parameters: ``create``'s
inserts, ``claim`` and ``finish`` (the exactly-once state changes), and the reads of one job.
``SqlRunStore`` runs them through SQLAlchemy, its DBAPI lane (``executor.store.fast``) as
they compile for the store's database.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Double,
    Integer,
    Row,
    String,
    and_,
    bindparam,
    case,
    delete,
    func,
    insert,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from executor.models import Status
from executor.store.base import CANCELLED_WHILE_RUNNING, OPEN_STATUSES, RunSummary
from executor.store.rows import error_json
from executor.store.schema import (
    JOB_COLUMNS,
    SafeText,
    UtcDateTime,
    idempotency,
    job_inputs,
    jobs,
)


def insert_job(dialect: Any) -> Any:
    """``create``'s INSERT of the job's row, executed with the row's values: on SQLite and
    PostgreSQL nothing when the id exists (``ON CONFLICT DO NOTHING``) and the id RETURNING
    where the database has it (rowcount of an INSERT is not reliable: -1 with psycopg)."""
    if dialect.name not in ("sqlite", "postgresql"):
        return insert(jobs)
    dialect_insert = sqlite_insert if dialect.name == "sqlite" else pg_insert
    stmt = dialect_insert(jobs).on_conflict_do_nothing(index_elements=[jobs.c.job_id])
    return stmt.returning(jobs.c.job_id) if dialect.insert_returning else stmt


#: the inputs' row of a new job (in the same transaction as its job's row)
INSERT_INPUTS = insert(job_inputs)


#: an idempotency key's row (parameters u: user, k: key_hash) with ``live_job``: its job's id
#: while the job's row exists (None once retention removed it)
SELECT_KEY = (
    select(
        idempotency.c.job_id,
        idempotency.c.request_hash,
        idempotency.c.expires_at,
        jobs.c.job_id.label("live_job"),
    )
    .select_from(idempotency.outerjoin(jobs, jobs.c.job_id == idempotency.c.job_id))
    .where(
        idempotency.c.user == bindparam("u", type_=String),
        idempotency.c.key_hash == bindparam("k", type_=String),
    )
)
#: an idempotency key's row if it still names the job it named when read (parameters u, k,
#: j: that job's id): a stale row is replaced, never a repeat's new one
DELETE_STALE_KEY = delete(idempotency).where(
    and_(
        idempotency.c.user == bindparam("u", type_=String),
        idempotency.c.key_hash == bindparam("k", type_=String),
        idempotency.c.job_id == bindparam("j", type_=String),
    )
)


def _p(name: str, type_: Any) -> Any:
    """A named parameter of a statement built once (``CLAIM``, ``FINISH``)."""
    return bindparam(name, type_=type_)


#: queued -> running (or running -> running: a redelivery); parameters c_id, c_at, c_ts, c_by
#: and c_again: the other status a claim may take, ``running`` for a redelivered message,
#: ``queued`` (so: only queued) for a first delivery (``SqlRunStore.claim``). A retry's
#: attempt is not claimed before its ``not_before_ts`` (a message that came early is
#: skipped; the sweep sends it again when due: worker.upkeep.retry_due).
CLAIM = (
    update(jobs)
    .where(
        jobs.c.job_id == _p("c_id", String),
        jobs.c.status.in_([Status.QUEUED.value, _p("c_again", String)]),
        or_(jobs.c.not_before_ts.is_(None), jobs.c.not_before_ts <= _p("c_ts", Double)),
    )
    .values(
        status=Status.RUNNING.value,
        started_at=_p("c_at", UtcDateTime),
        started_ts=_p("c_ts", Double),
        worker=_p("c_by", String),
        attempts=jobs.c.attempts + 1,
    )
)

CLAIM_RETURNING = CLAIM.returning(*JOB_COLUMNS)
SELECT_JOB = select(*JOB_COLUMNS).where(jobs.c.job_id == _p("r_id", String))

_CANCELLING = jobs.c.status == Status.CANCELLING.value
#: the result, once, on an open job; a job cancelled while it ran ends cancelled whatever it
#: returned (its logs, duration and trace are kept, its output is not). Parameters f_*.
FINISH = (
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
            (_CANCELLING, literal(error_json(CANCELLED_WHILE_RUNNING), SafeText)),
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
        # the attempts of a node with a retry policy (NULL: the row's own, unchanged)
        history=func.coalesce(_p("f_history", SafeText), jobs.c.history),
    )
)
#: running -> queued for the next attempt of a node's retry policy (executor.retry), once, by
#: the worker that holds the claim (a cancel meanwhile made it cancelling: no retry, its
#: finish ends it cancelled). Parameters r_id, r_by (the claim's worker), r_nb (not before,
#: Unix s), r_history, r_memory.
RETRY = (
    update(jobs)
    .where(
        jobs.c.job_id == _p("r_id", String),
        jobs.c.status == Status.RUNNING.value,
        jobs.c.worker == _p("r_by", String),
    )
    .values(
        status=Status.QUEUED.value,
        not_before_ts=_p("r_nb", Double),
        retry_sent=False,
        history=_p("r_history", SafeText),
        memory_bytes=_p("r_memory", BigInteger),
        claims_before=jobs.c.attempts,
        started_at=None,
        started_ts=None,
        worker=None,
    )
)
#: a QueuedJob's columns (rows.queued_job reads them)
QUEUED_COLUMNS = (
    jobs.c.job_id,
    jobs.c.kind,
    jobs.c.queued_at,
    jobs.c.worker_group,
    jobs.c.user,
    jobs.c.tenant,
    jobs.c.workflow,
)
#: queued attempts of a retry now due whose message no sweep sent yet (parameter now)
SELECT_DUE = (
    select(*QUEUED_COLUMNS)
    .where(
        jobs.c.status == Status.QUEUED.value,
        jobs.c.retry_sent.is_(False),
        jobs.c.not_before_ts <= _p("now", Double),
    )
    .order_by(jobs.c.not_before_ts)
    .limit(_p("lim", Integer))
)
#: the due attempt's message is this sweep's to send (once: parameter r_id)
MARK_SENT = (
    update(jobs)
    .where(
        jobs.c.job_id == _p("r_id", String),
        jobs.c.status == Status.QUEUED.value,
        jobs.c.retry_sent.is_(False),
    )
    .values(retry_sent=True)
)


#: the row as written: the finished record goes out with the job's done notice, so a waiter
#: does not read it back
FINISH_RETURNING = FINISH.returning(*JOB_COLUMNS)


def select_jobs(*, inputs: bool) -> Any:
    """SELECT of whole records; without ``inputs``, code and state are not read (the record
    holds "" and "{}"); with them, from ``job_inputs`` (NULL: the job has no row there).
    (One job's record is read in two statements instead, ``_read_inputs``.)"""
    if not inputs:
        return select(*JOB_COLUMNS)
    joined = jobs.outerjoin(job_inputs, job_inputs.c.job_id == jobs.c.job_id)
    return select(
        *JOB_COLUMNS,
        job_inputs.c.job_id.label("inputs_of"),
        job_inputs.c.code,
        job_inputs.c.state_json,
    ).select_from(joined)


def joined_inputs(row: Row[Any]) -> Row[Any] | None:
    """The inputs of a ``select_jobs(inputs=True)`` row: the row itself, if the job has them."""
    return row if row._mapping["inputs_of"] is not None else None


#: one job's inputs and one job's row: built once, executed with the id as a parameter (a
#: statement built per call costs its cache-key walk every time, about as much as running it)
SELECT_INPUTS = select(job_inputs.c.code, job_inputs.c.state_json).where(
    job_inputs.c.job_id == _p("r_id", String)
)


#: the columns a run-history row carries (no code, state, output, logs, trace): RunSummary's
SUMMARY_COLUMNS = tuple(jobs.c[name] for name in RunSummary.model_fields)
SELECT_SUMMARY = select(*SUMMARY_COLUMNS).where(jobs.c.job_id == _p("r_id", String))
SELECT_STATUS = select(jobs.c.status).where(jobs.c.job_id == _p("r_id", String))
#: why a claim took nothing: the row as the claim found it, in the claim's transaction
SELECT_UNCLAIMED = select(jobs.c.status, jobs.c.started_at).where(
    jobs.c.job_id == _p("r_id", String)
)
