"""The runs: submit, read, cancel, and the history and logs.

    POST /api/runs                  submit a workflow run's Code node (202)
    GET  /api/runs/{job_id}[?wait=S]  the run, with its result once finished (``wait``: a
                                    long poll that answers as soon as it finishes)
    POST /api/runs/{job_id}/cancel  cancel it (the worker kills its sandbox)
    GET  /api/runs                  the caller's runs (an admin: anyone's, or one user's),
                                    newest first, filtered, in pages with an opaque cursor
    GET  /api/runs/{job_id}/logs[?follow=1]   the stored logs, or live as Server-Sent Events

Each route's docstring, which the OpenAPI shows, says the rest.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Annotated, Any, Literal

import redis
from fastapi import APIRouter, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from api_client.client import RUNS_PAGE_MAX, JobNotFound
from api_client.http.kit import (
    ERRORS,
    ApiError,
    Caller,
    CallerDep,
    ErrorRoute,
    JobIdPath,
    Services,
    ServicesDep,
    error_response,
    idempotency_key,
    own_record,
    trace_headers,
)
from api_client.http.routes.code import _unless_disconnected as unless_disconnected
from api_client.http.wire import ErrorBody, RunBody, RunList, RunLogs, RunView, RunWaiting
from api_client.log_follower import follow_async
from executor.errors import ErrorCode
from executor.models import Status
from executor.store.base import JobRecord
from worker.protocol import done_key, record_of_notice

router = APIRouter(route_class=ErrorRoute)
_STREAM_ID = re.compile(r"(\d{1,20})-(\d{1,20})")
#: each part of a Redis stream id is an unsigned 64-bit number
_STREAM_PART_MAX = 2**64 - 1


def stream_id_refusal(value: str) -> str | None:
    """Why ``value`` is not a Last-Event-ID this stream could have sent (None: it is):
    ``<ms>-<seq>``, each part a number of at most 2^64-1, as Redis takes it."""
    m = _STREAM_ID.fullmatch(value)
    if m is None:
        return (
            "Last-Event-ID is not an event id of this stream (<number>-<number>): "
            "reconnect without it to start from the beginning."
        )
    if any(int(part) > _STREAM_PART_MAX for part in m.groups()):
        return (
            f"Last-Event-ID {value!r} has a part over 2^64-1 ({_STREAM_PART_MAX}), so no "
            "event of this stream has it: reconnect without it to start from the beginning."
        )
    return None


@router.post("/api/runs", response_model=RunView, status_code=202, tags=["runs"], responses=ERRORS)
async def submit_run(
    body: RunBody, who: CallerDep, services: ServicesDep, request: Request
) -> Response:
    """Queue a workflow run's Code node (queue code.run); poll GET /api/runs/{job_id}. A
    W3C ``traceparent`` header (and ``tracestate``) puts the run's spans in the caller's
    trace when the API and the workers export traces (docs/operations.md, Traces). An
    ``Idempotency-Key`` header makes a retry safe: the same key and request again (within
    STUDIO_IDEMPOTENCY_TTL_S) answer the first run as it is now, never a second run; the
    same key with another request is 409 IDEMPOTENCY_CONFLICT naming the first run."""
    key, traced = idempotency_key(request), trace_headers(request)

    def submit() -> JobRecord:
        job_id = services.client.submit(
            body.code,
            body.language,
            body.state,
            body.timeout_s,
            who.user,
            kind="run",
            memory=body.memory,
            cpus=body.cpus,
            retry=body.retry,
            tenant=body.tenant,
            workflow=body.workflow,
            group=body.group,
            idempotency_key=key,
            **traced,
        )
        rec = services.record(job_id)
        if rec is None:  # pragma: no cover
            raise ApiError(503, str(ErrorCode.RUNTIME_UNAVAILABLE), "The run was lost.")
        return rec

    # one hop to the thread pool (the submit and the read), and the view serialised once
    return _answer(RunView.of(await run_in_threadpool(submit)), 202)


def _answer(view: RunView, status: int = 200) -> Response:
    """``view`` as FastAPI would send it from response_model (the same JSON), serialised
    once by pydantic on the event loop, without validating it again on the way out."""
    return Response(view.model_dump_json(), status_code=status, media_type="application/json")


#: the longest ``GET /api/runs/{job_id}?wait=`` holds (below the usual 60 s proxy timeout)
RUN_WAIT_MAX_S = 30.0


@router.get("/api/runs/{job_id}", response_model=RunView, tags=["runs"], responses=ERRORS)
async def get_run(
    job_id: JobIdPath,
    who: CallerDep,
    services: ServicesDep,
    request: Request,
    wait: Annotated[
        float,
        Query(
            ge=0,
            le=RUN_WAIT_MAX_S,
            description="Seconds to wait for an unfinished run to finish before answering "
            f"(long poll, at most {RUN_WAIT_MAX_S:g}): the answer comes as soon as the run "
            "finishes, or the run as it is when the wait ends. 0 (default): at once.",
        ),
    ] = 0,
) -> Any:
    """The run and, once finished, its result. 404 for an unknown id or another user's
    run (unless the caller is an admin). A queued run says why it waits (``waiting``: no
    live worker, paused workers, its user's cap or turn, its place in its queue, with an
    estimate), naming no other user. ``wait``: a long poll instead of polling back to back
    (holds no thread while it waits: the worker's done notice wakes it)."""
    if wait <= 0:
        return _answer(await run_in_threadpool(_read_view, services, job_id, who))
    client = services.opened or await run_in_threadpool(lambda: services.client)
    ended = await _ended(client, job_id)
    if ended is not None and who.may_see(ended):  # as the wait would answer it at once
        return _answer(RunView.of(ended))
    rec = await run_in_threadpool(own_record, services, job_id, who)
    if not rec.status.finished:
        waited = client.wait_async(job_id, wait, submitted=True)
        try:
            got = await unless_disconnected(request, waited)
        except JobNotFound as e:  # removed while it was waited for
            raise ApiError(404, "NOT_FOUND", f"No run {job_id!r} that you can see.") from e
        if got is None:
            return error_response(
                499, "CLIENT_GONE", "The caller went away before the run finished."
            )
        rec = got
        if rec.status is Status.QUEUED:
            return _answer(await run_in_threadpool(_view, services, rec))
    return _answer(RunView.of(rec))


async def _ended(client: Any, job_id: str) -> JobRecord | None:
    """The finished record a done notice of ``job_id`` carries (what a wait wakes on and
    answers, worker.protocol), read on the event loop in one round trip; None when there
    is none (not finished, a long record, Redis unreadable): the store is read then."""
    try:
        items = await client.async_redis.lrange(done_key(job_id), 0, -1)
    except redis.RedisError:
        return None
    found = (record_of_notice(item) for item in items)
    return next((rec for rec in found if rec is not None), None)


def _read_view(services: Services, job_id: str, who: Caller) -> RunView:
    return _view(services, own_record(services, job_id, who))


def _view(services: Services, rec: JobRecord) -> RunView:
    """The run's view; a queued run's says why it waits."""
    view = RunView.of(rec)
    if rec.status is Status.QUEUED:
        why = services.client.why_waiting(rec)
        if why is not None:
            view.waiting = RunWaiting.model_validate(why.as_dict())
    return view


@router.post(
    "/api/runs/{job_id}/cancel",
    response_model=RunView,
    status_code=202,
    tags=["runs"],
    responses=ERRORS,
)
def cancel_run(job_id: JobIdPath, who: CallerDep, services: ServicesDep) -> RunView:
    """Cancel a run: a queued one never starts, a running one has its sandbox killed and
    ends ``cancelled``. Cancelling a cancelled run again is fine (202); one that finished
    otherwise answers 409."""
    rec = own_record(services, job_id, who)
    if rec.status.finished and rec.status is not Status.CANCELLED:
        raise ApiError(
            409,
            "CONFLICT",
            f"Run {job_id} already finished ({rec.status.value}); nothing to cancel.",
        )
    try:
        services.client.cancel(job_id)
    except JobNotFound as e:  # removed between the read and the cancel
        raise ApiError(404, "NOT_FOUND", f"No run {job_id!r} that you can see.") from e
    return RunView.of(services.record(job_id) or rec)


@router.get(
    "/api/runs",
    response_model=RunList,
    tags=["runs"],
    responses={**ERRORS, 403: {"model": ErrorBody}},
    operation_id="list_runs",
)
def list_runs(
    who: CallerDep,
    services: ServicesDep,
    status: Annotated[
        list[Status] | None,
        Query(description="Only these statuses (repeat the parameter for several)."),
    ] = None,
    language: Annotated[Literal["python", "typescript"] | None, Query()] = None,
    code_runtime: Annotated[
        Literal["docker", "subprocess"] | None,
        Query(
            description="Only runs of this runtime (subprocess: ran on the host, unsandboxed).",
        ),
    ] = None,
    kind: Annotated[
        Literal["run", "test"] | None,
        Query(description="run: workflow runs; test: editor test calls."),
    ] = None,
    since: Annotated[
        datetime | None, Query(description="Queued at or after (ISO 8601; no zone means UTC).")
    ] = None,
    until: Annotated[
        datetime | None, Query(description="Queued before (ISO 8601; no zone means UTC).")
    ] = None,
    user: Annotated[
        str | None,
        Query(
            max_length=200,
            description="Admins only: this user's runs (default: everyone's). "
            "Other callers always get their own.",
        ),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=RUNS_PAGE_MAX)] = 50,
    cursor: Annotated[
        str | None, Query(max_length=1000, description="next_cursor of the previous page.")
    ] = None,
) -> RunList:
    """Run history, newest first (the studio's Runs list, with ``code_runtime`` marked on
    each run). A caller sees its own runs; an admin sees every run, or one user's."""
    if not who.admin:
        if user is not None and user != who.user:
            raise ApiError(
                403, "FORBIDDEN", "Only an admin may list another user's runs: drop ``user``."
            )
        user = who.user
    try:
        page = services.client.list_runs(
            user=user,
            status=status,
            language=language,
            code_runtime=code_runtime,
            kind=kind,
            since=since,
            until=until,
            limit=limit,
            cursor=cursor,
        )
    except ValueError as e:
        raise ApiError(422, "REQUEST_INVALID", str(e)) from e
    return RunList(runs=page.runs, next_cursor=page.next_cursor)


@router.get(
    "/api/runs/{job_id}/logs",
    tags=["runs"],
    operation_id="get_run_logs",
    response_model=RunLogs,
    responses={
        **ERRORS,
        200: {
            "description": "Without follow: the stored logs (JSON). With follow=1: Server-Sent "
            "Events, ``text/event-stream``: ``log`` events carry text as the node prints it (at "
            "most STUDIO_CODE_LOG_MAX_BYTES in all), ``truncated`` the stored logs' truncation "
            "mark, ``rerun`` (data: JSON attempt) where a re-run after an attempt lost to the "
            "infrastructure starts (the text before it was the lost attempt's), and ``end`` "
            "(data: JSON status and logs_truncated) closes the stream once the run has "
            "finished, or with ``reason`` and ``message`` when the live view cannot go on "
            "(stream_refused, redis_unavailable). A reconnect with Last-Event-ID resumes "
            "after that event (each part of the id at most 2^64-1, else 422).",
            "content": {"application/json": {}, "text/event-stream": {}},
        },
    },
)
async def get_run_logs(
    job_id: JobIdPath,
    who: CallerDep,
    services: ServicesDep,
    request: Request,
    follow: Annotated[
        bool, Query(description="1: stream the logs live (SSE) until the run ends.")
    ] = False,
) -> Any:
    """The run's logs: stored (JSON), or followed live as Server-Sent Events."""
    rec = await asyncio.to_thread(own_record, services, job_id, who)
    if not follow:
        return RunLogs.of(rec)
    from sse_starlette.sse import EventSourceResponse, ServerSentEvent

    last_id = request.headers.get("last-event-id") or "0-0"
    refusal = stream_id_refusal(last_id)
    if refusal is not None:
        raise ApiError(422, "REQUEST_INVALID", refusal)
    # the client's pool: its read timeout waits longer than a follower's XREAD block
    client = services.client.async_redis
    store = services.client.store

    async def events() -> AsyncIterator[ServerSentEvent]:
        async for e in follow_async(
            client,
            job_id,
            lambda: store.get_summary(job_id),
            lambda: store.get(job_id, inputs=False),
            last_id=last_id,
        ):
            yield ServerSentEvent(data=e.data, event=e.event, id=e.id)

    return EventSourceResponse(events(), ping=15, headers={"Cache-Control": "no-store"})
