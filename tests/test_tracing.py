"""OpenTelemetry traces (executor.tracing): a traced ``POST /api/runs`` and ``POST
/api/code/test`` to a real API, run by a real Celery worker (prefork) in real Docker
sandboxes, export their spans over OTLP/HTTP to a receiver of the test's own on loopback
(testkit/otlp.py, decoding with opentelemetry-proto): the caller's trace id, and the
parent chain caller -> API submit -> the worker's main process (queue_wait) -> the pool
process (job -> sandbox_start, code_run, result_store). No trace id or OTEL_ variable reaches
the sandbox (its code reports its environment). Tracing off imports nothing of OpenTelemetry
(a CLI run and a worker's modules, each in a fresh interpreter)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.api import ApiServer
from testkit.imports import loaded_after
from testkit.otlp import Receiver, Span
from testkit.processes import children, wait_for
from testkit.redis import start_redis
from testkit.stack import studio_env
from testkit.worker import CeleryWorker, start_worker
from tests.snippets import USER

#: the sandbox's code reports its whole environment
ENV_CODE = "import os\n\ndef main(state):\n    return dict(os.environ)\n"


class Traced:
    def __init__(self, api: ApiServer, worker: CeleryWorker, receiver: Receiver) -> None:
        self.api, self.worker, self.receiver = api, worker, receiver
        self.http = httpx.Client(base_url=api.base, timeout=90)


@pytest.fixture(scope="module")
def t(
    tmp_path_factory: pytest.TempPathFactory, docker_client: Any, python_image: str
) -> Iterator[Traced]:
    tmp = tmp_path_factory.mktemp("tracing")
    with Receiver() as receiver, start_redis(tmp) as redis:
        env = studio_env(
            redis.url,
            f"sqlite:///{tmp / 'runs.db'}",
            python_image,
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
            OTEL_BSP_SCHEDULE_DELAY="50",  # export within 50 ms, not the default 5 s
        )
        with (
            start_worker(env, tmp / "worker.log", concurrency=2) as worker,
            ApiServer(env, tmp / "api.log") as api,
        ):
            t = Traced(api, worker, receiver)
            yield t
            t.http.close()


def _caller() -> tuple[str, str, str]:
    """A caller's trace id, span id and the W3C traceparent naming them."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def _one(spans: list[Span], name: str) -> Span:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, found)
    return found[0]


WORKER_SPANS = {
    "studio_code.queue_wait",
    "studio_code.job",
    "studio_code.sandbox_start",
    "studio_code.code_run",
    "studio_code.result_store",
}


def _check_worker_chain(t: Traced, spans: list[Span], submit: Span, job_id: str) -> None:
    """queue_wait (the worker's main process) under submit; job (a pool process) under
    queue_wait; the sandbox, the run and the store under job; each names the job."""
    wait = _one(spans, "studio_code.queue_wait")
    job = _one(spans, "studio_code.job")
    assert wait.parent_id == submit.span_id
    assert job.parent_id == wait.span_id
    for name in ("studio_code.sandbox_start", "studio_code.code_run", "studio_code.result_store"):
        assert _one(spans, name).parent_id == job.span_id, name
    for s in (submit, wait, *(s for s in spans if s.name in WORKER_SPANS)):
        assert s.attributes["studio.job_id"] == job_id, s
    # the processes: the API, the worker's main process, one of its pool processes
    assert submit.resource["process.pid"] == t.api.pid
    assert wait.resource["process.pid"] == t.worker.pid
    assert job.resource["process.pid"] in children(t.worker.pid)
    assert job.resource["studio.role"] == "pool" and wait.resource["studio.role"] == "worker"
    assert submit.resource["service.name"] == "studio-code"
    # the wait is from the API's send (inside submit) to the main process taking the message
    # (which may come before the API's submit span ends), before the pool process starts it
    assert submit.start_ns <= wait.start_ns <= submit.end_ns
    assert wait.start_ns <= wait.end_ns <= job.start_ns
    start, run = _one(spans, "studio_code.sandbox_start"), _one(spans, "studio_code.code_run")
    assert start.end_ns == run.start_ns and job.start_ns <= start.start_ns
    assert isinstance(start.attributes["studio.sandbox.pooled"], bool)
    for s in (job, run, _one(spans, "studio_code.result_store")):
        assert s.attributes["studio.status"] == "succeeded", s
        assert s.attributes["studio.runtime"] == "docker"
        assert s.attributes["studio.language"] == "python"


def _no_trace_in(env: dict[str, str], trace_id: str) -> None:
    """The sandbox's own view of its environment: no OTEL_ variable, no trace header."""
    assert env, "the sandbox reported no environment"
    assert [k for k in env if k.upper().startswith("OTEL_")] == []
    assert [k for k in env if k.lower() in ("traceparent", "tracestate")] == []
    assert [k for k, v in env.items() if trace_id in v] == []


@pytest.mark.redis
def test_a_traced_run_joins_the_callers_trace_through_api_worker_and_pool(t: Traced) -> None:
    trace_id, caller_span, traceparent = _caller()
    r = t.http.post(
        "/api/runs",
        json={"code": ENV_CODE},
        headers={USER: "tracer", "traceparent": traceparent, "tracestate": "studio=1"},
    )
    assert r.status_code == 202, r.text
    job_id = r.json()["job_id"]
    body = wait_for(
        lambda: (
            (b := t.http.get(f"/api/runs/{job_id}", headers={USER: "tracer"}).json())["finished"]
            and b
        ),
        60,
        "the run to finish",
    )
    assert body["status"] == "succeeded", body
    _no_trace_in(body["output"], trace_id)

    spans = t.receiver.wait_spans(trace_id, {"studio_code.submit", *WORKER_SPANS})
    submit = _one(spans, "studio_code.submit")
    assert submit.parent_id == caller_span
    assert submit.attributes["studio.kind"] == "run"
    _check_worker_chain(t, spans, submit, job_id)
    # it went through fair share (the users' lists: STUDIO_QUEUE_RUN_FAIRNESS=users), its
    # trace headers with it; its wait there is inside queue_wait
    assert _one(spans, "studio_code.queue_wait").attributes == {
        "studio.job_id": job_id,
        "studio.queue": "code.run",
        "studio.queue.fair_share_included": True,
    }


@pytest.mark.redis
def test_a_traced_editor_test_call_has_the_callers_wait(t: Traced) -> None:
    trace_id, caller_span, traceparent = _caller()
    r = t.http.post(
        "/api/code/test",
        json={"code": ENV_CODE},
        headers={USER: "tracer", "traceparent": traceparent},
    )
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "succeeded"
    _no_trace_in(r.json()["output"], trace_id)
    job_id = r.json()["job_id"]
    spans = t.receiver.wait_spans(
        trace_id, {"studio_code.submit", "studio_code.wait", *WORKER_SPANS}
    )
    submit, wait = _one(spans, "studio_code.submit"), _one(spans, "studio_code.wait")
    assert submit.parent_id == caller_span and wait.parent_id == caller_span
    assert submit.attributes["studio.kind"] == "test"
    assert wait.attributes["studio.job_id"] == job_id
    assert wait.attributes["studio.status"] == "succeeded"
    assert wait.end_ns >= _one(spans, "studio_code.result_store").end_ns
    queued = _one(spans, "studio_code.queue_wait").attributes
    assert queued["studio.queue"] == "code.test"
    assert queued["studio.queue.fair_share_included"] is False
    _check_worker_chain(t, spans, submit, job_id)


@pytest.mark.redis
def test_an_unreadable_traceparent_starts_a_trace_of_its_own(t: Traced) -> None:
    r = t.http.post(
        "/api/runs", json={"code": ENV_CODE}, headers={USER: "tracer", "traceparent": "00-zz"}
    )
    assert r.status_code == 202, r.text  # never refused for it (W3C Trace Context)
    job_id = r.json()["job_id"]

    def submit_span() -> Span | None:
        for s in t.receiver.spans:
            if s.name == "studio_code.submit" and s.attributes.get("studio.job_id") == job_id:
                return s
        return None

    submit = wait_for(submit_span, 30, "the submit span")
    assert submit.parent_id == "" and submit.attributes["studio.traceparent_invalid"] is True
    spans = t.receiver.wait_spans(submit.trace_id, WORKER_SPANS)
    _check_worker_chain(t, spans, submit, job_id)


# --- off: nothing of OpenTelemetry imported ---------------------------------------------------

NO_OTEL = {k: "" for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")}


#: what tracing loads (the SDK's tracer, the OTLP exporter, the W3C propagator). Not all of
#: ``opentelemetry``: redis-py 8 imports its API and, when installed, ``opentelemetry.sdk.
#: metrics`` for its own optional metrics, whatever this project does
TRACING_MODULES = (
    "opentelemetry.sdk.trace",
    "opentelemetry.exporter",
    "opentelemetry.trace.propagation.tracecontext",
    "opentelemetry.proto",
)


def _otel(mods: set[str]) -> list[str]:
    return sorted(m for m in mods if m.startswith(TRACING_MODULES))


@pytest.mark.parametrize("otel_env", [False, True])
def test_a_cli_run_imports_no_opentelemetry(tmp_path: Path, otel_env: bool) -> None:
    """``studio-code run`` never traces: no OpenTelemetry module, even with the variables
    set (only the API and the workers trace)."""
    node = tmp_path / "node.py"
    node.write_text("def main(state):\n    return state['n'] + 1\n")
    env = {"STUDIO_ENABLE_CODE_NODES": "1", "STUDIO_CODE_RUNTIME": "subprocess", **NO_OTEL}
    if otel_env:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://127.0.0.1:9"
    mods = loaded_after(
        f"""
        from api_client.cli import main
        assert main(["run", {str(node)!r}, "--state", '{{"n": 1}}']) == 0
    """,
        env=env,
    )
    assert "executor.tracing" in mods  # the hooks were there
    assert _otel(mods) == []
    assert sorted(m for m in mods if m.split(".")[0] == "opentelemetry") == []  # none at all


def test_a_worker_and_a_client_without_the_variables_import_no_opentelemetry(
    tmp_path: Path,
) -> None:
    """A worker's app (its signals connected), its task module and a client's submit path,
    built with tracing off: no OpenTelemetry module."""
    mods = loaded_after(
        """
        from executor.settings import load_settings
        from worker.assembly import worker_app
        import worker.job.tasks, worker.tracing, api_client.client
        from executor import tracing
        worker_app(load_settings())
        assert not tracing.on() and not worker.tracing._connected
        with tracing.submitting("00-" + "1" * 32 + "-" + "2" * 16 + "-01"):
            pass
    """,
        env={"STUDIO_ENABLE_CODE_NODES": "1", "STUDIO_DATA_DIR": str(tmp_path), **NO_OTEL},
    )
    assert "worker.job.tasks" in mods
    assert _otel(mods) == []


def test_the_variables_turn_tracing_on() -> None:
    from executor.tracing import wanted

    assert not wanted({})
    assert wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert wanted({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"})
    on = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}
    assert not wanted({**on, "OTEL_SDK_DISABLED": "true"})
    assert not wanted({**on, "OTEL_TRACES_EXPORTER": "none"})


def test_a_failing_hook_costs_the_job_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken exporter or SDK (here: the tracer cannot be made) never fails a submit, a
    wait or a job: each hook logs it and goes on without a span."""
    from executor import tracing

    def broken() -> None:
        raise RuntimeError("the SDK is broken")

    monkeypatch.setattr(tracing, "tracer", broken)
    monkeypatch.setattr(tracing, "_on", True)
    tp = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
    headers: dict[str, Any] = {}
    with tracing.submitting(tp, None) as span:
        assert span is None
        tracing.message_headers(headers, object(), "docker")
    assert headers == {}
    with tracing.job(tp, None, "j1") as span:
        assert span is None
    with tracing.waiting("j1", tp, None) as span:
        assert tracing.waited(span, "rec") == "rec"
    with pytest.raises(ValueError):  # the job's own exception comes out as itself
        with tracing.submitting(tp, None):
            raise ValueError("bad code")


def test_a_subprocess_sandbox_sees_no_trace_while_its_process_traces(
    make_subprocess_executor: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The subprocess runtime, in a process that traces (the OTEL_ variables set, a job span
    open, as in a worker's pool process): the run's code sees none of it, and the
    executor's sandbox_start and code_run spans go under the job span."""
    from executor import tracing
    from executor.models import CodeJob

    for name in ("_on", "_pid", "_tracer", "_provider"):  # this process's state, restored
        monkeypatch.setattr(tracing, name, getattr(tracing, name))
    with Receiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "studio-code-test")
        tracing.set_enabled(None)
        ex = make_subprocess_executor()
        trace_id, caller_span, traceparent = _caller()
        with tracing.job(traceparent, "studio=1", "job-1"):
            result = ex.run(CodeJob(job_id="job-1", code=ENV_CODE))
        tracing.flush()
        assert result.status == "succeeded", result.error
        _no_trace_in(result.output, trace_id)
        spans = receiver.wait_spans(
            trace_id, {"studio_code.job", "studio_code.sandbox_start", "studio_code.code_run"}
        )
    job = _one(spans, "studio_code.job")
    assert job.parent_id == caller_span
    assert job.resource["service.name"] == "studio-code-test"  # OTEL_SERVICE_NAME wins
    for name in ("studio_code.sandbox_start", "studio_code.code_run"):
        span = _one(spans, name)
        assert span.parent_id == job.span_id
        assert span.attributes["studio.runtime"] == "subprocess"
    run = _one(spans, "studio_code.code_run")
    assert run.attributes["studio.status"] == "succeeded"
    assert result.usage is not None  # the host measured it: the span says the same
    assert run.attributes["studio.usage.cpu_ms"] == result.usage.cpu_ms
    assert run.attributes["studio.usage.source"] == result.usage.source
