"""Run history and operations routes, beside the core routes of ``api_client.http``:

    GET /api/runs        the caller's runs (an admin: anyone's, or one user's), newest first,
                         filtered, in pages with an opaque cursor
    GET /api/runs/{job_id}/logs[?follow=1]   the stored logs, or live as Server-Sent Events

``create_app`` includes this router; a studio that mounts ``api_client.http.router`` itself
includes ``api_client.routes_runs.router`` too.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request

from api_client.client import RUNS_PAGE_MAX
from api_client.http import (
    ERRORS,
    ApiError,
    CallerDep,
    ErrorBody,
    ErrorRoute,
    JobIdPath,
    ServicesDep,
    _own_record,
)
from api_client.wire import RunList, RunLogs
from executor.models import Status

router = APIRouter(route_class=ErrorRoute)
_STREAM_ID = re.compile(r"\d{1,20}-\d{1,20}")


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
            "mark, and ``end`` (data: JSON status and logs_truncated) closes the stream once the "
            "run has finished. A reconnect with Last-Event-ID resumes after that event.",
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
    rec = await asyncio.to_thread(_own_record, services, job_id, who)
    if not follow:
        return RunLogs.of(rec)
    from sse_starlette.sse import EventSourceResponse, ServerSentEvent

    from api_client.live_logs import follow_async

    last_id = request.headers.get("last-event-id") or "0-0"
    if not _STREAM_ID.fullmatch(last_id):
        raise ApiError(
            422,
            "REQUEST_INVALID",
            "Last-Event-ID is not an event id of this "
            "stream: reconnect without it to start from the beginning.",
        )
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
