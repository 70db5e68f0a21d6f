"""The run store's contract: one row per Code-node job, written by workers, read by the API.

Every state change is a single conditional ``UPDATE ... WHERE job_id = ? AND status IN (...)``
whose row count says whether this caller won, so any number of processes on any number of
machines may call these methods at once for the same job:

    queued --claim--> running --finish--> succeeded | failed | timed_out | invalid | cancelled
       |                 |   \\--claim (redelivered: a worker died)--> running
       |                 \\--request_cancel--> cancelling --finish / fail_stuck--> cancelled
       \\--request_cancel--> cancelled
    running | cancelling --fail_stuck (worker gone past its deadline)--> failed | cancelled

A finished row (succeeded, failed, timed_out, cancelled, invalid) is never changed again.
"""

from __future__ import annotations

import base64
import binascii
import json
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from types import TracebackType
from typing import Any, NamedTuple, Self

from pydantic import BaseModel, ConfigDict, Field

from executor.errors import ErrorCode
from executor.models import (
    Attempt,
    CodeErrorInfo,
    CodeJob,
    CodeResult,
    Kind,
    Language,
    RetryPolicy,
    Status,
    TraceRow,
    Usage,
)

CANCELLED_BEFORE_START = CodeErrorInfo(
    code=ErrorCode.CODE_CANCELLED, message="Cancelled before it started."
)
CANCELLED_WHILE_RUNNING = CodeErrorInfo(
    code=ErrorCode.CODE_CANCELLED, message="Cancelled while running."
)
WORKER_STOPPED = "The worker running this job stopped; run it again."

#: Statuses a worker may still write a result over.
OPEN_STATUSES = (Status.QUEUED, Status.RUNNING, Status.CANCELLING)


class JobRecord(BaseModel):
    """One job as the run store holds it. Datetimes are timezone-aware UTC."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    status: Status
    kind: Kind = "run"
    user: str = ""
    language: Language = "python"
    code: str = ""
    state_json: str = "{}"
    timeout_s: float | None = None
    code_runtime: str = ""
    runtime: str | None = None  # CodeResult.runtime, set by finish()
    output: Any = None
    error: CodeErrorInfo | None = None
    logs: str = ""
    logs_truncated: bool = False
    warnings: list[str] = Field(default_factory=list)
    trace: list[TraceRow] = Field(default_factory=list)
    exit_code: int | None = None
    duration_ms: float | None = None
    queued_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    worker: str | None = None
    attempts: int = 0
    #: columns of the stored row that could not be read (each shown with its default and
    #: named here): a worker does not run such a job, it ends it failed
    problems: list[str] = Field(default_factory=list)
    pruned_at: datetime | None = None  # retention cleared code, state, output and logs
    memory_bytes: int | None = None  # what the node asked for (None: the server's default)
    cpus: float | None = None
    #: the worker group it was sent to (executor.groups; None: the default group)
    worker_group: str | None = None
    #: its concurrency keys as the submit gave them (executor.keys.check_key; "": none)
    tenant: str = ""
    workflow: str = ""
    usage: Usage | None = None  # what the run used, measured by the host (None: not measured)
    #: the node's retry policy (executor.retry) and its attempts so far
    retry: RetryPolicy | None = None
    history: list[Attempt] = Field(default_factory=list)
    #: its next attempt may not be claimed before this Unix time (a retry's delay)
    not_before_ts: float | None = None
    #: a worker's sweep sent the message of the attempt due at ``not_before_ts``
    retry_sent: bool = False
    #: claims of its earlier attempts (``attempts`` counts every claim)
    claims_before: int = 0

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def claims(self) -> int:
        """Claims of the current attempt: what the infrastructure's re-run budget
        (worker.protocol.MAX_ATTEMPTS) counts; a code retry starts it again."""
        return self.attempts - self.claims_before

    @property
    def code_attempt(self) -> int:
        """The number of the current (or last) attempt of the code, from 1."""
        if self.finished:
            return max(1, len(self.history))
        return len(self.history) + 1

    def to_job(self) -> CodeJob:
        """The job this record holds, to run it: every field of CodeJob from the record's
        own field of the same name."""
        return CodeJob.model_validate({name: getattr(self, name) for name in CodeJob.model_fields})

    def to_result(self) -> CodeResult | None:
        """The CodeResult this record holds, or None while the job has not finished."""
        if not self.finished:
            return None
        # every field of CodeResult from the record's own field of the same name
        fields = {name: getattr(self, name) for name in CodeResult.model_fields}
        fields.update(
            runtime=self.runtime or self.code_runtime, duration_ms=self.duration_ms or 0.0
        )
        return CodeResult.model_validate(fields)


class QueuedJob(NamedTuple):
    """A job still waiting in a queue, as the sweeps of queued jobs see it."""

    job_id: str
    kind: str
    queued_at: datetime
    #: its worker group (executor.groups; None: the default group)
    worker_group: str | None = None
    #: its user, tenant and workflow (a message sent again goes to their lane: worker.fair)
    user: str = ""
    tenant: str = ""
    workflow: str = ""


class RunSummary(BaseModel):
    """One run as the history lists it: no code, state, output or logs (those stay in
    ``get``). Datetimes are timezone-aware UTC."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    status: Status
    kind: Kind = "run"
    user: str = ""
    language: Language = "python"
    code_runtime: str = ""
    runtime: str | None = None
    error: CodeErrorInfo | None = None
    duration_ms: float | None = None
    queued_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    worker: str | None = None
    attempts: int = 0
    usage: Usage | None = None

    @property
    def finished(self) -> bool:
        return self.status.finished


@dataclass(frozen=True)
class Ended:
    """What ``finish_with_outcome`` wrote: the job's final status and error, and (when the
    store read it back in the same statement) the finished record as ``status`` returns it
    (no code or state), which the job's done notice carries to its waiters."""

    status: Status
    error: CodeErrorInfo | None
    record: JobRecord | None = field(default=None, compare=False, repr=False)


class Claim(NamedTuple):
    """What ``try_claim`` answered, in its one transaction: the job, claimed (``record``),
    or why not, from the row as the claim found it: ``status`` (None: no such job) and
    ``started`` (whether it had started before)."""

    record: JobRecord | None
    status: Status | None = None
    started: bool = False

    @property
    def unknown(self) -> bool:
        """No such job in this store."""
        return self.record is None and self.status is None

    @property
    def cancelled_queued(self) -> bool:
        """Not claimed: it was cancelled while queued (it never started)."""
        return self.status is Status.CANCELLED and not self.started

    @property
    def open(self) -> bool:
        """Not claimed and not ended: queued (a retry's attempt before its time), running
        (another delivery's) or cancelling."""
        return self.record is None and self.status is not None and not self.status.finished


class RunFilter(BaseModel):
    """What ``list_runs`` keeps: every given field must match (None: any)."""

    model_config = ConfigDict(frozen=True)

    user: str | None = None
    status: tuple[Status, ...] | None = None
    language: Language | None = None
    code_runtime: str | None = None
    kind: Kind | None = None
    since: datetime | None = None  # queued_at >= since
    until: datetime | None = None  # queued_at < until


class PruneReport(BaseModel):
    """What one ``prune`` call did: rows deleted, payloads cleared, batches run (each one
    short transaction of at most ``batch`` rows)."""

    deleted: int = 0
    payloads_cleared: int = 0
    keys_removed: int = 0  # expired idempotency keys
    batches: int = 0
    max_batch_rows: int = 0


@dataclass(frozen=True)
class KeyedJob:
    """The job an idempotency key names (``RunStore.find_key``, ``create_keyed``): its id,
    the digest of the request that made it, and whether this call made it."""

    job_id: str
    request_hash: str
    created: bool = False


class AuditEntry(BaseModel):
    """One audit event (e.g. ``system.code_runtime_subprocess``)."""

    model_config = ConfigDict(frozen=True)

    id: int
    at: datetime
    event: str
    actor: str
    details: dict[str, Any] = Field(default_factory=dict)


class RunStore(ABC):
    """Where jobs and their results live. Safe to use from many processes and machines."""

    @abstractmethod
    def create(self, job: CodeJob, *, code_runtime: str) -> bool:
        """Insert a ``queued`` row. A second call with the same job_id changes nothing.
        Returns True when this call inserted the row."""

    @abstractmethod
    def create_keyed(
        self,
        job: CodeJob,
        *,
        code_runtime: str,
        key_hash: str,
        request_hash: str,
        expires_at: datetime,
    ) -> KeyedJob:
        """``create`` under an idempotency key: in one transaction, the key's row (the
        unique (user, key_hash) concurrent repeats race on) and the job's. When the key of
        ``job.user`` already names a job that still exists and has not expired, nothing is
        written and that job is returned (``created`` False); the caller compares the
        request digests."""

    @abstractmethod
    def find_key(self, user: str, key_hash: str) -> KeyedJob | None:
        """The live job the key of ``user`` names (None: no such key, expired, or its job
        was removed by retention)."""

    @abstractmethod
    def get(self, job_id: str, *, inputs: bool = True) -> JobRecord | None:
        """The job, or None if unknown. ``inputs=False``: without its code and state (the
        record holds "" and "{}"), which callers that show or wait for a job never need."""

    def get_many(self, job_ids: Iterable[str], *, inputs: bool = True) -> dict[str, JobRecord]:
        """The known jobs among ``job_ids``, by id."""
        out: dict[str, JobRecord] = {}
        for job_id in job_ids:
            rec = self.get(job_id, inputs=inputs)
            if rec is not None:
                out[job_id] = rec
        return out

    def statuses(self, job_ids: Iterable[str]) -> dict[str, Status]:
        """The status of each known job among ``job_ids``: what a waiter re-reads every
        second, so backends answer it without loading code, state or output."""
        return {job_id: rec.status for job_id, rec in self.get_many(job_ids, inputs=False).items()}

    def get_summary(self, job_id: str) -> RunSummary | None:
        """The job without its code, state, output or logs; None if unknown."""
        rec = self.get(job_id, inputs=False)
        return (
            None
            if rec is None
            else RunSummary(**rec.model_dump(include=set(RunSummary.model_fields)))
        )

    def claim(self, job_id: str, worker: str, *, again: bool = True) -> JobRecord | None:
        """queued -> running, or running -> running when redelivered (attempts += 1, new
        worker, new started_at). None (nothing changed) when the job is unknown, cancelling,
        cancelled or finished: the worker must not run it. ``again=False`` (a message's
        first delivery, never handed back by the broker) takes only a queued job: a running
        one is another copy's (the queued sweep's resend of a message a slow holder still
        has), never a redelivery after a worker's death."""
        return self.try_claim(job_id, worker, again=again).record

    @abstractmethod
    def try_claim(self, job_id: str, worker: str, *, again: bool = True) -> Claim:
        """``claim``, answering in the same transaction why not when it does not claim (the
        row's status and whether it had started; no status: unknown), so the worker reads
        the row no more after a failed claim."""

    @abstractmethod
    def request_cancel(self, job_id: str) -> Status | None:
        """queued -> cancelled at once; running -> cancelling (the worker stops it and its
        finish() ends it ``cancelled``); otherwise unchanged. The status after the call,
        None if unknown."""

    @abstractmethod
    def is_cancel_requested(self, job_id: str) -> bool:
        """True when the job is cancelling or cancelled."""

    @abstractmethod
    def finish(self, result: CodeResult, *, worker: str) -> bool:
        """Write the result once, while the job is queued, running or cancelling; a
        cancelling job ends ``cancelled`` whatever the result says. True when this call
        wrote it; False (nothing changed) for a finished or unknown job."""

    def finish_with_outcome(self, result: CodeResult, *, worker: str) -> Ended | None:
        """``finish``, telling what the job ended with (a cancelling job ends cancelled, an
        output the store refuses makes it failed): None when nothing was written. A worker
        reports that to Celery without reading the row back."""
        if not self.finish(result, worker=worker):
            return None
        run = self.get_summary(result.job_id)
        return None if run is None else Ended(run.status, run.error)

    @abstractmethod
    def fail_stuck(
        self,
        older_than_s: float,
        reason: str = WORKER_STOPPED,
        *,
        default_timeout_s: float = 30.0,
        keep: Collection[str] = (),
    ) -> list[str]:
        """Running/cancelling jobs whose started_at + timeout_s + older_than_s has passed end
        ``failed`` (``cancelled`` if cancelling) with RUNTIME_UNAVAILABLE and ``reason``.
        ``default_timeout_s`` stands for a job created without a timeout. Jobs in ``keep``
        (e.g. whose message is still in the broker: it will be delivered again and run to
        its real outcome) are left alone. The ids changed."""

    @abstractmethod
    def audit(self, event: str, details: dict[str, Any], *, actor: str = "system") -> None:
        """Record an audit event."""

    @abstractmethod
    def list_audit(self, event: str | None = None, limit: int = 100) -> list[AuditEntry]:
        """Audit events, newest first, optionally of one event name."""

    @abstractmethod
    def list_runs(
        self, where: RunFilter, *, limit: int = 50, before: tuple[datetime, str] | None = None
    ) -> list[RunSummary]:
        """Runs matching ``where``, newest first by (queued_at, job_id), at most ``limit``,
        starting strictly after the cursor ``before`` (the last row of the previous page)."""

    @abstractmethod
    def finished_since(self, kind: Kind, since: datetime) -> int:
        """How many jobs of ``kind`` ended at or after ``since``: a queue's recent pace."""

    @abstractmethod
    def oldest_queued_at(self, kind: Kind | None = None) -> datetime | None:
        """When the oldest job still ``queued`` (of this kind) was queued; None when none is."""

    @abstractmethod
    def prune(
        self,
        *,
        runs_before: datetime | None,
        payloads_before: datetime | None,
        keys_before: datetime | None = None,
        batch: int = 500,
        max_batches: int = 20,
    ) -> PruneReport:
        """Retention: finished runs that finished before ``runs_before`` are deleted; the
        code, state, output and logs of finished runs that finished before
        ``payloads_before`` are cleared (the row, its status, error, timings and trace
        stay); idempotency keys that expired before ``keys_before`` are removed. At most
        ``batch`` rows per transaction and ``max_batches`` transactions per call, so a
        writer never waits long behind it; call again for more."""

    @abstractmethod
    def counts_by_status(self) -> dict[str, int]:
        """Number of jobs per status; every Status value is present (0 when none)."""

    # --- the store's identity and the sweeps of queued jobs ------------------------------
    # Not abstract, so a store written before them still loads; the SQL store has them.

    @property
    def store_id(self) -> str:
        """An id written once when the store was created: two processes that show the same
        id use the same store."""
        return ""

    def describe(self) -> str:
        """Where the store is, for logs and errors (a URL without its password)."""
        return repr(self)

    def list_queued(
        self, older_than_s: float, *, kind: str | None = None, limit: int = 1000
    ) -> list[QueuedJob]:
        """Jobs ``queued`` for more than ``older_than_s`` seconds (of ``kind`` if given),
        oldest first."""
        raise NotImplementedError

    def fail_queued(self, job_ids: Iterable[str], message: str) -> list[str]:
        """queued -> failed (RUNTIME_UNAVAILABLE, ``message``) for each job of ``job_ids``
        that is STILL queued (one conditional UPDATE: a job a worker claimed meanwhile is
        left alone). The ids changed."""
        raise NotImplementedError

    # --- a node's retries (executor.retry) -----------------------------------------------

    def retry(
        self,
        job_id: str,
        worker: str,
        *,
        history: list[Attempt],
        not_before_ts: float,
        memory_bytes: int | None,
    ) -> bool:
        """running -> queued for the next attempt, once, by ``worker`` (the claim's): not
        claimable before ``not_before_ts`` (Unix s), with ``history`` (every attempt so far)
        and ``memory_bytes``; the claims so far leave the infrastructure's budget. False
        (nothing changed) when the job is not running under that worker (a cancel made it
        cancelling: it is then finished, and ends cancelled)."""
        raise NotImplementedError

    def due_retries(self, *, limit: int = 500) -> list[QueuedJob]:
        """Queued attempts whose delay has passed and whose message no sweep sent yet."""
        raise NotImplementedError

    def mark_retry_sent(self, job_id: str) -> bool:
        """The due attempt's message is the caller's to send: True once per attempt."""
        raise NotImplementedError

    @abstractmethod
    def close(self) -> None:
        """Release connections. The store must not be used afterwards."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def encode_cursor(row: RunSummary) -> str:
    """The opaque cursor of the page after ``row`` (the last row of a page)."""
    raw = json.dumps([row.queued_at.isoformat(), row.job_id], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    """(queued_at, job_id) of a cursor from ``encode_cursor``; ValueError when it is not one."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        at_text, job_id = json.loads(raw)
        at = datetime.fromisoformat(at_text)
        if at.tzinfo is None or not isinstance(job_id, str):
            raise ValueError
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError):
        raise ValueError(
            "not a cursor of this API: pass next_cursor from the previous page as it came"
        ) from None
    return at, job_id
