"""Run history and operations routes, beside the core routes of ``api_client.http``:

    GET /api/runs        the caller's runs (an admin: anyone's, or one user's), newest first,
                         filtered, in pages with an opaque cursor

``create_app`` includes this router; a studio that mounts ``api_client.http.router`` itself
includes ``api_client.routes_runs.router`` too.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

from api_client.client import RUNS_PAGE_MAX
from api_client.http import ERRORS, ApiError, CallerDep, ErrorBody, ErrorRoute, ServicesDep
from executor.models import Status
from executor.store import RunSummary

router = APIRouter(route_class=ErrorRoute)


class RunList(BaseModel):
    """One page of run history: summaries without code, state, output or logs (read one
    run with GET /api/runs/{job_id})."""

    runs: list[RunSummary]
    next_cursor: str | None = Field(
        None, description="Pass as ``cursor`` for the next page; null on the last page.")


@router.get("/api/runs", response_model=RunList, tags=["runs"],
            responses={**ERRORS, 403: {"model": ErrorBody}}, operation_id="list_runs")
def list_runs(
    who: CallerDep,
    services: ServicesDep,
    status: Annotated[list[Status] | None, Query(
        description="Only these statuses (repeat the parameter for several).")] = None,
    language: Annotated[Literal["python", "typescript"] | None, Query()] = None,
    code_runtime: Annotated[Literal["docker", "subprocess"] | None, Query(
        description="Only runs of this runtime (subprocess: ran on the host, unsandboxed).",
    )] = None,
    kind: Annotated[Literal["run", "test"] | None, Query(
        description="run: workflow runs; test: editor test calls.")] = None,
    since: Annotated[datetime | None, Query(
        description="Queued at or after (ISO 8601; no zone means UTC).")] = None,
    until: Annotated[datetime | None, Query(
        description="Queued before (ISO 8601; no zone means UTC).")] = None,
    user: Annotated[str | None, Query(
        max_length=200, description="Admins only: this user's runs (default: everyone's). "
        "Other callers always get their own.")] = None,
    limit: Annotated[int, Query(ge=1, le=RUNS_PAGE_MAX)] = 50,
    cursor: Annotated[str | None, Query(
        max_length=1000, description="next_cursor of the previous page.")] = None,
) -> RunList:
    """Run history, newest first (the studio's Runs list, with ``code_runtime`` marked on
    each run). A caller sees its own runs; an admin sees every run, or one user's."""
    if not who.admin:
        if user is not None and user != who.user:
            raise ApiError(403, "FORBIDDEN",
                           "Only an admin may list another user's runs: drop ``user``.")
        user = who.user
    try:
        page = services.client.list_runs(
            user=user, status=status, language=language, code_runtime=code_runtime,
            kind=kind, since=since, until=until, limit=limit, cursor=cursor)
    except ValueError as e:
        raise ApiError(422, "REQUEST_INVALID", str(e)) from e
    return RunList(runs=page.runs, next_cursor=page.next_cursor)
