"""One home per record and per rule: the wire and store records are derived from the models
(a field is written once), and each mapping (error code -> HTTP status, error code -> run
status, the timeout cap) has one home that every caller reads. A real SQLite run store."""

from __future__ import annotations

from pathlib import Path

import pytest

from api_client.http.wire import RunLogs, RunView
from executor.errors import ErrorCode
from executor.inputs import capped_timeout_s, timeout_s
from executor.models import CodeErrorInfo, CodeJob, CodeResult, Status, TraceRow
from executor.store import open_store


def _job() -> CodeJob:
    return CodeJob(
        language="python",
        code="def main(state):\n    return 1\n",
        state_json='{"n": 1}',
        timeout_s=2.5,
        kind="test",
        user="ann",
        memory_bytes=64 * 1024**2,
        cpus=0.25,
    )


def test_a_job_and_its_result_come_back_from_the_store_field_for_field(tmp_path: Path) -> None:
    job = _job()
    result = CodeResult(
        job_id=job.job_id,
        language="python",
        status=Status.FAILED,
        output=None,
        error=CodeErrorInfo(code=ErrorCode.CODE_ERROR, message="boom"),
        logs="printed\n",
        logs_truncated=False,
        runtime="subprocess",
        code_runtime="subprocess",
        duration_ms=12.5,
        exit_code=1,
        warnings=["runs on host"],
        trace=[TraceRow(step="code.run", runtime="subprocess", duration_ms=3.0)],
    )
    with open_store(f"sqlite:///{tmp_path / 'runs.db'}") as store:
        assert store.create(job, code_runtime="subprocess")
        queued = store.get(job.job_id)
        assert queued is not None and queued.problems == []
        assert queued.to_job() == job  # every CodeJob field, written by create, read back
        assert queued.to_result() is None  # not finished
        assert store.claim(job.job_id, "w1") is not None
        assert store.finish(result, worker="w1")
        rec = store.get(job.job_id)
        summary = store.get_summary(job.job_id)
    assert rec is not None and summary is not None
    assert rec.to_result() == result
    view = RunView.of(rec)
    # each field of the view is the record's own, but ``waiting``: where a run held back by
    # fairness waits comes from Redis (GET /api/runs/{id} adds it), never from the store
    assert view.waiting is None
    for name in RunView.model_fields.keys() - {"waiting"}:
        assert getattr(view, name) == getattr(rec, name), name
    assert view.finished is True and view.memory_bytes == 64 * 1024**2 and view.cpus == 0.25
    assert RunLogs.of(rec).model_dump() == {
        "job_id": job.job_id,
        "status": Status.FAILED,
        "finished": True,
        "logs": "printed\n",
        "logs_truncated": False,
    }
    for name in type(summary).model_fields:  # the history row: the record's fields too
        assert getattr(summary, name) == getattr(rec, name), name


def test_a_record_without_a_runtime_or_duration_gives_a_result_with_the_fallbacks(
    tmp_path: Path,
) -> None:
    with open_store(f"sqlite:///{tmp_path / 'runs.db'}") as store:
        job = _job()
        store.create(job, code_runtime="docker")
        store.request_cancel(job.job_id)  # queued -> cancelled: no runtime, no duration
        rec = store.get(job.job_id)
    assert rec is not None
    result = rec.to_result()
    assert result is not None
    assert (result.status, result.runtime, result.code_runtime, result.duration_ms) == (
        Status.CANCELLED,
        "docker",
        "docker",
        0.0,
    )
    assert result.error is not None and result.error.code is ErrorCode.CODE_CANCELLED


@pytest.mark.parametrize(
    ("code", "http", "status"),
    [
        (ErrorCode.CODE_INVALID, 400, Status.INVALID),
        (ErrorCode.RATE_LIMITED, 429, Status.FAILED),
        (ErrorCode.CODE_NODES_DISABLED, 503, Status.FAILED),
        (ErrorCode.RUNTIME_UNAVAILABLE, 503, Status.FAILED),
        (ErrorCode.CODE_TIMEOUT, 503, Status.TIMED_OUT),
        (ErrorCode.CODE_CANCELLED, 503, Status.CANCELLED),
        (ErrorCode.CODE_ERROR, 503, Status.FAILED),
        (ErrorCode.CODE_MEMORY, 503, Status.FAILED),
        (ErrorCode.CODE_OUTPUT_INVALID, 503, Status.FAILED),
    ],
)
def test_each_error_code_has_one_http_status_and_one_run_status(
    code: ErrorCode, http: int, status: Status
) -> None:
    assert code.http_status == http
    assert Status.ended_by(code) is status


@pytest.mark.parametrize(
    ("given", "capped"), [(None, 30.0), (0, 30.0), (-1, 30.0), (2.5, 2.5), (30, 30.0), (3600, 30.0)]
)
def test_one_timeout_cap(given: float | None, capped: float) -> None:
    assert capped_timeout_s(given, max_seconds=30) == capped
    if given is None or given > 0:  # the input rule refuses the others, then caps the same
        assert timeout_s(given, max_seconds=30) == capped
