"""The job that goes into a sandbox, the limits it runs under, and the result that comes out."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from executor.errors import ErrorCode

Language = Literal["python", "typescript"]
Kind = Literal["run", "test"]


class Status(StrEnum):
    """How a job ended (or where it is). ``cancelled`` covers both a job killed while running
    and one removed before it ran; the run store's timings (started_at) tell them apart."""

    QUEUED = "queued"
    RUNNING = "running"
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    INVALID = "invalid"

    @property
    def finished(self) -> bool:
        return self in FINISHED

    @classmethod
    def ended_by(cls, code: ErrorCode) -> Status:
        """The status of a job that ended with the error ``code``: the one mapping of
        error codes to statuses (the executor and the CLI read it here)."""
        return _ENDED_BY.get(code, cls.FAILED)


FINISHED = frozenset(
    {Status.SUCCEEDED, Status.FAILED, Status.TIMED_OUT, Status.CANCELLED, Status.INVALID}
)
_ENDED_BY = {
    ErrorCode.CODE_INVALID: Status.INVALID,
    ErrorCode.CODE_TIMEOUT: Status.TIMED_OUT,
    ErrorCode.CODE_CANCELLED: Status.CANCELLED,
}


class Limits(BaseModel):
    """What one call may use. Built from Settings; a request can lower, never raise them."""

    model_config = ConfigDict(frozen=True)

    memory_bytes: int
    cpus: float
    pids: int
    timeout_s: float
    log_max_bytes: int
    output_max_bytes: int


#: outcomes a retry policy may name (CODE_ERROR only when the caller names it); every other
#: code is deterministic or not the code's: a retry would only burn a worker
RETRYABLE_CODES = (ErrorCode.CODE_TIMEOUT, ErrorCode.CODE_MEMORY, ErrorCode.CODE_ERROR)
#: the most attempts a policy may ask for, and the longest delay between two (seconds)
MAX_RETRY_ATTEMPTS = 10
MAX_RETRY_DELAY_S = 3600.0


class Backoff(BaseModel):
    """The delay before attempt n+1: ``initial_s * factor**(n-1)``, at most ``max_s``, then
    spread by up to ``jitter`` of itself (0: exact)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    initial_s: float = Field(default=1.0, ge=0.0, le=MAX_RETRY_DELAY_S)
    factor: float = Field(default=2.0, ge=1.0, le=10.0)
    max_s: float = Field(default=60.0, ge=0.0, le=MAX_RETRY_DELAY_S)
    jitter: float = Field(default=0.1, ge=0.0, le=1.0)


class RetryPolicy(BaseModel):
    """A node's own retries (opt-in): up to ``max_attempts`` attempts in all, another one
    only after an outcome in ``on`` (CODE_TIMEOUT, CODE_MEMORY, CODE_ERROR). Infrastructure
    re-runs are not attempts of the code (worker.job.rerun keeps their own budget)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_attempts: int = Field(default=2, ge=1, le=MAX_RETRY_ATTEMPTS)
    backoff: Backoff = Field(default_factory=lambda: Backoff())
    on: tuple[ErrorCode, ...] = (ErrorCode.CODE_TIMEOUT, ErrorCode.CODE_MEMORY)


class Attempt(BaseModel):
    """One attempt of a node with a retry policy, as its run's ``history`` lists it."""

    model_config = ConfigDict(frozen=True)

    attempt: int
    status: str
    code: str | None = None
    message: str = ""
    duration_ms: float = 0.0
    usage: dict[str, Any] | None = None
    #: the memory this attempt ran with (bytes)
    memory_bytes: int | None = None
    worker: str | None = None
    ended_at: float | None = None  # Unix seconds
    #: set when another attempt follows: when it may start (Unix seconds), its memory
    retry_at: float | None = None
    next_memory_bytes: int | None = None


class CodeJob(BaseModel):
    """One Code node call. ``state_json`` is the state as JSON text, passed through untouched."""

    model_config = ConfigDict(frozen=True)

    job_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    language: Language = "python"
    code: str
    state_json: str = "{}"
    timeout_s: float | None = None
    kind: Kind = "run"
    user: str = ""
    # What the node asked for, up to STUDIO_CODE_MAX_MEMORY / STUDIO_CODE_MAX_CPUS; None:
    # STUDIO_CODE_MEMORY / STUDIO_CODE_CPUS.
    memory_bytes: int | None = None
    cpus: float | None = None
    #: the node's retry policy (None: one attempt, the default)
    retry: RetryPolicy | None = None
    #: the worker group it goes to (executor.groups; None: the default group)
    worker_group: str | None = None
    #: its concurrency keys (worker.fair; "": none): in its message and in the run store
    #: (NULL: none), so a message sent again without its fair state goes to its own lane
    tenant: str = ""
    workflow: str = ""


class CodeErrorInfo(BaseModel):
    """The machine code and the sentence that says what happened and what to do."""

    model_config = ConfigDict(frozen=True)

    code: ErrorCode
    message: str


class TraceRow(BaseModel):
    """One step of a call as the studio's trace shows it; ``runtime`` is always set."""

    model_config = ConfigDict(frozen=True)

    step: str
    runtime: str
    duration_ms: float
    detail: str = ""


UsageSource = Literal["cgroup-v2", "cgroup-v1", "rusage"]


class Usage(BaseModel):
    """What a run used, measured by the host (its sandbox's cgroup, or the kernel's rusage
    of the process), never claimed by the code. A figure the source
    cannot tell is None. docs/operations.md, "What a run used", says what each counts."""

    model_config = ConfigDict(frozen=True)

    #: the sandbox's peak memory (its interpreter included), in bytes
    memory_peak_bytes: int | None = None
    #: CPU time (user + system) of the job, in ms: a pre-started sandbox's start is not in it
    cpu_ms: float | None = None
    #: the most processes (and threads) the sandbox had at once, where the source tells
    pids_peak: int | None = None
    #: where memory and processes were read
    source: UsageSource
    #: where the CPU time was read, when not ``source`` (a subprocess run's rusage)
    cpu_source: UsageSource | None = None


class CodeResult(BaseModel):
    """What a call produced. A timeout, OOM or bad return is a result with an error, not an
    exception: only infrastructure failures raise."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    language: Language
    status: Status
    output: Any = None
    error: CodeErrorInfo | None = None
    logs: str = ""
    logs_truncated: bool = False
    runtime: str
    code_runtime: str
    duration_ms: float = 0.0
    exit_code: int | None = None
    # lambdas, not the builtin ``list``: pydantic reads a default factory's signature, and a
    # builtin's costs a first tokenize (its big regex compiled, ~5 ms) in a one-shot run
    warnings: list[str] = Field(default_factory=lambda: [])
    trace: list[TraceRow] = Field(default_factory=lambda: [])
    #: what the run used, measured by the host; None when it was not measured (killed
    #: before, the sandbox gone, or STUDIO_CODE_USAGE=0): never 0 for "unknown"
    usage: Usage | None = None
    #: every attempt of a node with a retry policy, the last one included ([]: no policy)
    history: list[Attempt] = Field(default_factory=lambda: [])
    # What became of the run's sandbox, for the job path to decide on (worker.job.rerun):
    # typed here, set by the executor (``with_sandbox``), never in the result's JSON (its
    # trace rows say the same to people, and nothing reads them back).
    _started: bool = PrivateAttr(default=False)
    _lost: str | None = PrivateAttr(default=None)
    _refused: str | None = PrivateAttr(default=None)

    @property
    def started(self) -> bool:
        """True when the code ran in a sandbox and the executor read how it ended; False
        when the run ended before that (refused, cancelled or failed before its start,
        its sandbox lost)."""
        return self._started

    @property
    def lost(self) -> str | None:
        """The machine-readable cause when the infrastructure killed the run's sandbox
        (``InfrastructureLost``: the engine went away, the sandbox vanished, ...); else
        None. Never the code's doing."""
        return self._lost

    @property
    def refused(self) -> str | None:
        """``"limits"`` (the node's own limits) or ``"engine"`` (the server's defaults) when
        the engine refused the run's sandbox before its input was written
        (``SandboxRefused``); else None."""
        return self._refused

    def with_sandbox(
        self, *, started: bool = False, lost: str | None = None, refused: str | None = None
    ) -> CodeResult:
        """This result, saying what became of its sandbox (``started``, ``lost``,
        ``refused``)."""
        out = self.model_copy()
        out._started, out._lost, out._refused = started, lost, refused
        return out

    @classmethod
    def ended(
        cls,
        job_id: str,
        language: Language,
        status: Status,
        code: ErrorCode,
        message: str,
        *,
        runtime: str,
    ) -> CodeResult:
        """A job that ended without running to a result (cancelled, worker lost, refused)."""
        return cls(
            job_id=job_id,
            language=language,
            status=status,
            error=CodeErrorInfo(code=code, message=message),
            runtime=runtime,
            code_runtime=runtime,
        )

    def cli_dict(self) -> dict[str, Any]:
        """The stable JSON object printed by ``studio-code run``."""
        return self.model_dump(mode="json")


@dataclass
class RawRun:
    """What a sandbox did, before the executor reads it as a CodeResult (a runtime's
    ``run`` returns it; a language reads its crash and result bytes from it)."""

    exit_code: int | None
    stdout: bytes
    stdout_truncated: bool
    logs: bytes
    logs_total: int
    timed_out: bool = False
    oom_killed: bool = False
    cancelled: bool = False
    start_ms: float = 0.0
    run_ms: float = 0.0
    #: the sandbox was pre-started (taken from the runtime's pool), not started for this job
    pooled: bool = False
    #: what the sandbox used, read by the runtime before removing it (None: not measured)
    usage: Usage | None = None

    @property
    def logs_truncated(self) -> bool:
        return self.logs_total > len(self.logs)
