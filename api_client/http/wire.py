"""The HTTP API's wire records: what a request carries and what a route answers.

Pydantic models only, beside no route (``api_client.http.routes`` holds the routes, which
import these names from here). A run's view is derived from the run store's
``JobRecord`` field by field of the model itself (``RunView.of``), so a field added to both
is written once.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from executor.errors import CodeInvalid
from executor.floors import MIN_CPUS
from executor.inputs import check_cpus
from executor.keys import KEY_MAX, check_key
from executor.models import Attempt, CodeErrorInfo, RetryPolicy, Status, TraceRow, Usage
from executor.retry import parse_policy
from executor.store.base import JobRecord, RunSummary

#: the longest source a request may carry, in characters
CODE_MAX_CHARS = 1_000_000
#: the type of a body error that the executor's own rule (executor.inputs) raised: the API
#: answers it as that rule's CODE_INVALID, with its sentence (api_client.http.kit)
CODE_INVALID_ERROR = "code_invalid"


class ErrorInfo(BaseModel):
    code: str = Field(description="CODE_INVALID, RATE_LIMITED, NOT_FOUND, ...")
    message: str = Field(description="What happened and what to do.")
    problems: list[Problem] | None = Field(
        None, description="CODE_INVALID from /api/code/validate: each problem found."
    )
    retry_after_s: int | None = Field(None, description="RATE_LIMITED: seconds to wait.")


class Problem(BaseModel):
    line: int | None = None
    message: str


class ErrorBody(BaseModel):
    error: ErrorInfo


ErrorInfo.model_rebuild()

LanguageName = Literal["python", "typescript"]


class CodeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: str = Field(max_length=CODE_MAX_CHARS, description="The node's source.")
    language: LanguageName = "python"
    memory: str | None = Field(
        None,
        max_length=20,
        description="Memory the node asks for (e.g. 512m); at most "
        "STUDIO_CODE_MAX_MEMORY. Default: STUDIO_CODE_MEMORY.",
    )
    cpus: float | None = Field(
        None,
        le=64,
        json_schema_extra={"minimum": MIN_CPUS},
        description=f"CPU share the node asks for; from {MIN_CPUS:g} (below: 400 "
        "CODE_INVALID) to STUDIO_CODE_MAX_CPUS. Default: STUDIO_CODE_CPUS.",
    )
    timeout_s: float | None = Field(
        None,
        gt=0,
        le=86400,
        description="Seconds; at save time at most STUDIO_CODE_MAX_SECONDS (a run caps it there).",
    )
    group: str | None = Field(
        None,
        max_length=32,
        description="The worker group to run on (default, or one of STUDIO_WORKER_GROUPS); "
        "none: chosen by size (the smallest group whose slot holds memory and cpus).",
    )

    retry: RetryPolicy | None = Field(
        None,
        description="The node's retry policy: {max_attempts (1..10), backoff: {initial_s, "
        "factor, max_s, jitter}, on: [CODE_TIMEOUT, CODE_MEMORY, CODE_ERROR]}; any other "
        "outcome in ``on`` is 400 CODE_INVALID. A CODE_MEMORY retry asks for more memory "
        "(up to STUDIO_CODE_MAX_MEMORY). Default: the server's STUDIO_CODE_RETRY (off).",
    )

    @field_validator("retry", mode="before")
    @classmethod
    def _retry(cls, v: Any) -> Any:
        try:
            return parse_policy(v)
        except CodeInvalid as e:
            raise PydanticCustomError(
                CODE_INVALID_ERROR, "{message}", {"message": e.message}
            ) from None

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, v: float | None) -> float | None:
        # the floor here (the cap is the server's: CodeClient checks it), by the one rule
        try:
            check_cpus(v, max_cpus=None)
        except CodeInvalid as e:
            raise PydanticCustomError(
                CODE_INVALID_ERROR, "{message}", {"message": e.message}
            ) from None
        return v


class RunBody(CodeBody):
    state: dict[str, Any] = Field(
        default_factory=dict, description="The workflow state; the code gets a JSON copy."
    )
    timeout_s: float | None = Field(
        None,
        gt=0,
        le=86400,
        description="Seconds; capped by STUDIO_CODE_MAX_SECONDS (a request can only lower it).",
    )
    tenant: str | None = Field(
        None,
        json_schema_extra={"maxLength": KEY_MAX},
        description="The run's tenant (a concurrency key: STUDIO_QUEUE_RUN_SHARE_KEY, "
        f"_TENANT_SLOTS): 1 to {KEY_MAX} letters, digits, '.', '_', ':' or '-'.",
    )
    workflow: str | None = Field(
        None,
        json_schema_extra={"maxLength": KEY_MAX},
        description="The run's workflow (a concurrency key: STUDIO_QUEUE_RUN_WORKFLOW_SLOTS, "
        f"per tenant): 1 to {KEY_MAX} letters, digits, '.', '_', ':' or '-'.",
    )

    @field_validator("tenant", "workflow")
    @classmethod
    def _key(cls, v: str | None, info: ValidationInfo) -> str | None:
        try:
            check_key(str(info.field_name), v)
        except CodeInvalid as e:
            raise PydanticCustomError(
                CODE_INVALID_ERROR, "{message}", {"message": e.message}
            ) from None
        return v


class ValidateResult(BaseModel):
    ok: bool
    language: LanguageName
    problems: list[Problem] = Field(default_factory=list)


class PausedWorker(BaseModel):
    nodename: str
    reason: str | None = None


class RunWaiting(BaseModel):
    """Why a queued run (or editor test call) waits, in words (``reason``) and fields
    (docs/operations.md, "Why a run waits")."""

    queue: str = Field(description="The queue it goes to: code.run or code.test.")
    held_by: Literal[
        "no_worker",
        "other_store",
        "workers_paused",
        "retry_delay",
        "user_cap",
        "tenant_cap",
        "workflow_cap",
        "fairness",
        "queue",
        "taken",
    ] = Field(
        description="no_worker: no live worker serves its queue; other_store: the only ones "
        "use another run store; workers_paused: every worker of its queue is paused "
        "(``paused``); retry_delay: its last attempt failed and its next one waits out "
        "the retry policy's delay until ``not_before``; user_cap: its user has "
        "STUDIO_QUEUE_RUN_USER_SLOTS runs in flight, "
        "it goes when one of them ends; tenant_cap, workflow_cap: the same for its tenant "
        "(STUDIO_QUEUE_RUN_TENANT_SLOTS) or its workflow (_WORKFLOW_SLOTS); fairness: it "
        "waits for its user's turn; queue: it "
        "waits in its queue for a free slot; taken: a worker is starting it."
    )
    reason: str = Field(description="The same in a sentence, with what to do when any.")
    position: int | None = Field(
        default=None,
        description="Runs ahead of it: its user's own (user_cap, fairness) or the queue's (queue).",
    )
    users_ahead: int | None = Field(
        default=None, description="Users whose turn comes before its user's next one."
    )
    users_waiting: int | None = Field(
        default=None, description="Users with runs waiting, its own included."
    )
    workers: int = Field(default=0, description="Live workers serving its queue.")
    slots: int = Field(default=0, description="Their slots.")
    paused: list[PausedWorker] = Field(
        default_factory=list, description="Paused workers of its queue, with their reasons."
    )
    estimate_s: float | None = Field(
        default=None,
        description="Seconds until it starts at the queue's pace of the last 5 minutes "
        "(null: no run of its kind ended then).",
    )
    not_before: datetime | None = Field(
        default=None, description="retry_delay: when its next attempt may start."
    )


class RunView(BaseModel):
    """One Code-node job as the studio sees it; the result fields fill in once finished."""

    job_id: str
    status: Status
    finished: bool
    kind: Literal["run", "test"]
    user: str
    language: LanguageName
    timeout_s: float | None = None
    memory_bytes: int | None = None
    cpus: float | None = None
    output: Any = None
    error: CodeErrorInfo | None = None
    logs: str = ""
    logs_truncated: bool = False
    runtime: str | None = None
    code_runtime: str = ""
    duration_ms: float | None = None
    exit_code: int | None = None
    warnings: list[str] = Field(default_factory=list)
    trace: list[TraceRow] = Field(default_factory=list)
    usage: Usage | None = Field(
        None,
        description="What the run used, measured by the host: memory_peak_bytes, cpu_ms, "
        "pids_peak and their source; null when not measured (never 0 for unknown).",
    )
    queued_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    worker: str | None = None
    attempts: int = 0
    retry: RetryPolicy | None = Field(None, description="The node's retry policy, if any.")
    history: list[Attempt] = Field(
        default_factory=list,
        description="Every attempt of a node with a retry policy so far: its outcome code, "
        "message, duration, usage and the memory it ran with (and, when another followed, "
        "when and with how much memory). Empty without a policy.",
    )
    waiting: RunWaiting | None = Field(
        None,
        description="Only GET /api/runs/{job_id} of a queued run: why it waits.",
    )

    @classmethod
    def of(cls, rec: JobRecord) -> RunView:
        """The view of a run-store record: each field of this model read from the record's
        attribute of the same name (``finished`` is its property)."""
        return cls.model_validate(rec, from_attributes=True)


class LanguageMeta(BaseModel):
    name: str
    offered: bool
    ready: bool
    reason: str | None = None
    image: str | None = None
    packages: list[str] = Field(default_factory=list)
    versions: dict[str, str] = Field(
        default_factory=dict,
        description="The image's packages at the versions built in (its studio.packages "
        "label): PyPI name or npm:name@major -> version; empty when the image does not say.",
    )
    packages_warning: str | None = Field(
        None,
        description="STUDIO_CODE_PACKAGES or STUDIO_CODE_TS_PACKAGES disagrees with the image: "
        "the names that differ, in one sentence.",
    )


class LimitsMeta(BaseModel):
    model_config = ConfigDict(extra="allow")

    memory: str
    memory_bytes: int
    cpus: float
    pids: int
    max_seconds: float
    concurrency: int
    test_per_minute: int


class MemorySpread(BaseModel):
    median: int
    max: int


class PreimportLanguage(BaseModel):
    """One language's pre-import, from the live workers' heartbeats."""

    modules: list[str] = Field(
        default_factory=list,
        description="What the workers' pre-started sandboxes import while they wait "
        "(STUDIO_CODE_PREIMPORT); empty: nothing.",
    )
    workers: int = Field(0, description="Live workers whose pools measured the figures below.")
    idle_memory_bytes: MemorySpread | None = Field(
        None,
        description="Anonymous memory of an idle pre-started sandbox once its pre-imports are "
        "done (its cgroup, read by the host), median and largest across those workers.",
    )
    without_preimport_bytes: MemorySpread | None = Field(
        None, description="The same, of a sandbox of the same shape started without pre-import."
    )
    preimport_bytes: MemorySpread | None = Field(
        None,
        description="What the pre-imports add (idle minus without), counted against the "
        "sandbox's own memory limit; null when nothing is pre-imported or not measured yet.",
    )
    memory_limit_bytes: int | None = Field(
        None, description="The sandbox's memory limit (STUDIO_CODE_MEMORY) the figures count in."
    )
    note: str | None = Field(
        None,
        description="Why there is no figure (nothing is pre-imported, no pre-started sandboxes, "
        "not measured yet, cgroups unreadable), in one sentence; null when measured.",
    )


class PreimportMeta(BaseModel):
    """Heavy imports before the job, as the live workers announce them."""

    languages: dict[str, PreimportLanguage] = Field(default_factory=dict)
    workers: dict[str, dict[str, Any] | None] = Field(
        default_factory=dict,
        description="Each live worker's announcement (null: it announces none): pooled "
        "(it keeps pre-started sandboxes) and, per language, its modules and figures.",
    )
    error: str | None = None


class RuntimeMeta(BaseModel):
    """GET /api/meta/runtime: what the editor and the admin's Code nodes card show."""

    model_config = ConfigDict(extra="allow")

    enabled: bool
    reason: str | None = None
    code_runtime: str
    isolated: bool
    languages: list[LanguageMeta]
    limits: LimitsMeta
    sandbox_user: dict[str, Any]
    warnings: list[str] = Field(default_factory=list)
    pool: dict[str, Any] | None = None
    engine: dict[str, Any] | None = Field(
        None,
        description="The Docker engine under the sandboxes and its known container escapes: "
        "this_process (the answering process's engine, null without one), workers (each live "
        "worker's, from its heartbeat), refuse_vulnerable (STUDIO_CODE_ENGINE_REFUSE_VULNERABLE).",
    )
    preimport: PreimportMeta | None = Field(
        None,
        description="What the workers' pre-started sandboxes import while they wait and the "
        "memory it holds (STUDIO_CODE_PREIMPORT), per language, from the workers' heartbeats.",
    )
    groups: dict[str, Any] | None = Field(
        None,
        description="The worker groups (STUDIO_WORKER_GROUPS; default first): per group, what "
        "one slot holds (memory_bytes, cpus: what a job is routed by), its queues, and its "
        "live workers with what their slots hold, their slots per queue and state.",
    )


class Health(BaseModel):
    ok: bool
    checks: dict[str, str | None]
    workers: dict[str, Any] | None = None


class LanguageBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    language: LanguageName = "python"


class NodeCheck(BaseModel):
    ok: bool
    language: LanguageName


class RunList(BaseModel):
    """One page of run history: summaries without code, state, output or logs (read one
    run with GET /api/runs/{job_id})."""

    runs: list[RunSummary]
    next_cursor: str | None = Field(
        None, description="Pass as ``cursor`` for the next page; null on the last page."
    )


class RunLogs(BaseModel):
    """A run's stored logs (the truth once it has finished)."""

    job_id: str
    status: Status
    finished: bool
    logs: str
    logs_truncated: bool

    @classmethod
    def of(cls, rec: JobRecord) -> RunLogs:
        return cls.model_validate(rec, from_attributes=True)
