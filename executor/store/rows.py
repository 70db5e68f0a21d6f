"""A job's row as a record and a record's values as a row: what ``code_jobs`` holds (JSON text
for lists and dicts, text every database can encode) and the ``JobRecord``/``RunSummary`` read
from it, strictly, or field by field when a value cannot be read.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Row

from executor.errors import ErrorCode
from executor.keys import stored_key
from executor.models import (
    Attempt,
    CodeErrorInfo,
    CodeResult,
    RetryPolicy,
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
from executor.store.base import JobRecord, QueuedJob, RunSummary
from executor.store.schema import INPUTS, jobs


def dumps(value: Any) -> str:
    # ensure_ascii keeps lone surrogates and NULs escaped: the text is always storable.
    return json.dumps(value, separators=(",", ":"))


def storable(value: str) -> str:
    """``value`` without lone surrogates (neither database can encode them)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "replace").decode("utf-8")
    return value


def error_json(error: CodeErrorInfo | None) -> str | None:
    # not model_dump_json: pydantic refuses to encode a lone surrogate, and a node's own
    # error message can hold one (it becomes U+FFFD here; dumps escapes NUL)
    if error is None:
        return None
    return dumps({"code": str(error.code), "message": safe_text(error.message)})


def output_json(result: CodeResult) -> tuple[str | None, CodeErrorInfo | None]:
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


def record(row: Any, inputs: Any | None = None) -> JobRecord:
    """The record of a ``code_jobs`` row (``JOB_COLUMNS``: SQLAlchemy's ``Row``, or the
    lane's row that reads the same way); ``inputs``: its code and state (its
    ``code_job_inputs`` row), None when not read or not there ("" and "{}")."""
    try:
        return _record_strict(row, inputs)
    except Exception:  # noqa: BLE001 - one bad value must not make the row unreadable
        return _record_tolerant(row, inputs)


#: the columns of ``code_jobs`` that are fields of JobRecord, in the table's order (neither
#: started_ts nor the inputs): both readers below go over them, so a column added to the
#: table and the record is read without another line here
_RECORD_COLUMNS = tuple(
    c.name for c in jobs.columns if c.name in JobRecord.model_fields and c.name not in INPUTS
)


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
        usage=usage_of(m["usage"]),
        retry=retry_of(m["retry"]),
        history=history_of(m["history"]),
        retry_sent=bool(m["retry_sent"]),
        tenant=stored_key(m["tenant"]),
        workflow=stored_key(m["workflow"]),
    )
    return JobRecord(**fields)


def queued_job(row: Any) -> QueuedJob:
    """The QueuedJob of a row of ``statements.QUEUED_COLUMNS``."""
    return QueuedJob(
        row.job_id,
        row.kind,
        row.queued_at,
        row.worker_group,
        row.user,
        stored_key(row.tenant),
        stored_key(row.workflow),
    )


def retry_of(v: Any) -> RetryPolicy | None:
    return None if v is None else RetryPolicy.model_validate_json(v)


def history_of(v: Any) -> list[Attempt]:
    return [] if v is None else [Attempt.model_validate(a) for a in json.loads(v)]


def usage_of(v: Any) -> Usage | None:
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
    "worker_group": "a worker group's name",
    "tenant": "a key",
    "workflow": "a key",
    "usage": "a usage object ({memory_peak_bytes, cpu_ms, pids_peak, source})",
    "retry": "a retry policy ({max_attempts, backoff, on})",
    "history": "a JSON list of attempts",
    "not_before_ts": "a Unix time",
    "retry_sent": "true or false",
    "claims_before": "an integer",
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
        value = _raw(inputs if name in INPUTS and inputs is not None else row, name)
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
        "usage": usage_of,
        "retry": retry_of,
        "history": history_of,
        "retry_sent": bool,
        "tenant": stored_key,
        "workflow": stored_key,
    }
    job_id = _raw(row, "job_id")
    fields["job_id"] = str(job_id) if not isinstance(job_id, Exception) else "?"
    for name in _RECORD_COLUMNS + (INPUTS if inputs is not None else ()):
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


def summary(row: Any) -> RunSummary:
    m = row._mapping
    fields = {name: m[name] for name in RunSummary.model_fields}
    fields.update(
        status=Status(m["status"]),
        error=None if m["error"] is None else CodeErrorInfo.model_validate_json(m["error"]),
        usage=usage_of(m["usage"]),
    )
    return RunSummary(**fields)
