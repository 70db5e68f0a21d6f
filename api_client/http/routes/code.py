"""The editor's routes: what it sees, the save-time check, the node check, the test call.

    GET  /api/meta/runtime          what the editor sees (no user needed)
    POST /api/code/validate         save-time check: 200, or 400 CODE_INVALID with the reason
    POST /api/code/nodes/check      workflow validation of a node: can this language run now
    POST /api/code/test             an editor test call: rate limited per user per minute
                                    and in flight (429 with Retry-After), runs on queue
                                    code.test, waits (bounded, async: no thread held)

Each route's docstring, which the OpenAPI shows, says the rest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from fastapi import APIRouter, Request, Response
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from api_client.http.inflight import Slot
from api_client.http.kit import (
    ERRORS,
    ApiError,
    CallerDep,
    ErrorRoute,
    ServicesDep,
    admin_caller,
    error_response,
    idempotency_key,
    trace_headers,
)
from api_client.http.wire import (
    CodeBody,
    ErrorBody,
    LanguageBody,
    NodeCheck,
    Problem,
    RunBody,
    RuntimeMeta,
    RunView,
    ValidateResult,
)
from executor.errors import ErrorCode
from executor.inputs import capped_timeout_s
from executor.store.base import JobRecord

#: waited for a test call's result on top of its own timeout: queue wait and sandbox start
TEST_WAIT_MARGIN_S = 30.0
#: a test call whose body is at most this long is checked on the event loop (its code's
#: parse and its state's size check take well under a millisecond); a longer one in a thread
INLINE_CHECK_BYTES = 64 * 1024


def _problems(raw: Any) -> list[Problem]:
    out = []
    for p in raw or []:
        line = getattr(p, "line", None) or None  # the executor's 0 means "no line"
        out.append(Problem(line=line, message=getattr(p, "message", str(p))))
    return out


router = APIRouter(route_class=ErrorRoute)


@router.get(
    "/api/meta/runtime",
    response_model=RuntimeMeta,
    tags=["meta"],
    responses={503: {"model": ErrorBody}},
)
def get_runtime_meta(services: ServicesDep, request: Request) -> dict[str, Any]:
    """Enabled, runtime, each language's readiness (its test program ran) and packages,
    the limits in force, the workers and the fair share of code.run. ``fairness.top`` is
    by rank; it names the users only to an admin (X-Studio-User with X-Studio-Admin: 1)."""
    names = admin_caller(request.headers)
    return services.client.meta(names=names)  # type: ignore[no-any-return]


@router.post("/api/code/validate", response_model=ValidateResult, tags=["code"], responses=ERRORS)
def validate_code(body: CodeBody, who: CallerDep, services: ServicesDep) -> ValidateResult:
    """The save-time check: 200 when the code may be saved, else 400 CODE_INVALID whose
    message (and ``problems``) give the reason."""
    problems = _problems(
        services.client.validate(
            body.code,
            body.language,
            memory=body.memory,
            cpus=body.cpus,
            timeout_s=body.timeout_s,
            group=body.group,
        )
    )
    if problems:
        raise ApiError(
            400,
            str(ErrorCode.CODE_INVALID),
            "; ".join(
                p.message if p.line is None else f"line {p.line}: {p.message}" for p in problems
            ),
            problems=[p.model_dump() for p in problems],
        )
    return ValidateResult(ok=True, language=body.language)


@router.post("/api/code/nodes/check", response_model=NodeCheck, tags=["code"], responses=ERRORS)
def check_node(body: LanguageBody, who: CallerDep, services: ServicesDep) -> NodeCheck:
    """Workflow validation of a Code node: 200 when a node of this language can run now;
    503 CODE_NODES_DISABLED or RUNTIME_UNAVAILABLE, or 400 CODE_INVALID for a language that
    is not offered, each with the reason and how to fix it."""
    services.client.validate_node(body.language)
    return NodeCheck(ok=True, language=body.language)


@router.post(
    "/api/code/test",
    response_model=RunView,
    tags=["code"],
    responses={
        **ERRORS,
        202: {
            "model": RunView,
            "description": "Not finished within the wait: poll GET /api/runs/{job_id}.",
        },
    },
)
async def test_code(
    body: RunBody,
    who: CallerDep,
    services: ServicesDep,
    request: Request,
) -> Any:
    """An editor test call: at most STUDIO_CODE_TEST_PER_MINUTE per user per minute and
    STUDIO_CODE_TEST_IN_FLIGHT waiting at once (then 429 with Retry-After), run on the
    code.test queue, answered with the result (200) or, when it takes longer than its
    timeout plus a margin, with the run so far (202). A W3C ``traceparent`` header (and
    ``tracestate``) puts the call's spans in the caller's trace when tracing is on. An
    ``Idempotency-Key`` header makes a retry safe: the same key and request again answer
    with the first call's run (waited for as this call would be, outside the limits: it
    queues nothing); the same key with another request is 409 IDEMPOTENCY_CONFLICT."""
    s = services.settings
    # the first call of a process opens the run store: never on the event loop
    client = services.opened or await run_in_threadpool(lambda: services.client)
    wait_s = capped_timeout_s(body.timeout_s, max_seconds=s.code_max_seconds) + TEST_WAIT_MARGIN_S
    policy = body.retry or s.retry_policy
    if policy is not None:  # every attempt and every delay between two (executor.retry)
        b = policy.backoff
        delays = (policy.max_attempts - 1) * b.max_s * (1 + b.jitter)
        wait_s = wait_s * policy.max_attempts + delays
    aredis = client.async_redis
    # Before its job is stored: its admission (its in-flight slot and its place in the
    # per-minute count) and whether a live worker serves code.test (the submit believes a
    # yes it finds) go to Redis at once, in ONE round trip (a pipeline), and while they are
    # on the wire the job is checked here (a small body: no I/O, a fraction of a
    # millisecond; a big one is checked in a thread). A refusal is said in the order it
    # always was: 429, then the job's own error (400), then no worker (503).

    def prepare() -> Any:
        return client.prepare(
            body.code,
            body.language,
            body.state,
            body.timeout_s,
            who.user,
            "test",
            memory=body.memory,
            cpus=body.cpus,
            retry=body.retry,
            tenant=body.tenant,
            workflow=body.workflow,
            group=body.group,
        )

    key = idempotency_key(request)
    keyed_job: Any = None
    if key is not None:
        # A repeat of a keyed call is answered with its first job, before any admission:
        # it queues nothing, so it takes no in-flight slot and no place in the count.
        keyed_job = await run_in_threadpool(prepare)
        first = await run_in_threadpool(client.first_of_key, keyed_job, key)
        if first is not None:
            wait = client.wait_async(first, wait_s, submitted=True, **trace_headers(request))
            return _answer(await _unless_disconnected(request, wait))
    # the test queue of the job's worker group (executor.groups), as far as the body says;
    # None: a live worker was found within SERVED_CACHE_S (nothing to read)
    served = client.served_check(*client.test_queue_hint(body.memory, body.cpus, body.group))
    admitted = asyncio.ensure_future(
        services.in_flight.admit(
            aredis, who.user, wait_s + 5, s.code_test_per_minute, beside=served
        )
    )

    length = request.headers.get("content-length", "")
    inline = length.isdigit() and int(length) <= INLINE_CHECK_BYTES
    checked: asyncio.Future[Any] | None = None
    try:
        if keyed_job is not None:  # checked above already
            await asyncio.sleep(0)
            checked = asyncio.get_running_loop().create_future()
            checked.set_result(keyed_job)
        elif inline:
            # one turn of the loop first: the admission sends its commands, then waits
            # for the answers while the job is checked here
            await asyncio.sleep(0)
            checked = asyncio.get_running_loop().create_future()
            try:
                checked.set_result(prepare())
            except Exception as e:  # noqa: BLE001 - said after the admission's answer
                checked.set_exception(e)
        else:
            checked = asyncio.ensure_future(run_in_threadpool(prepare))
        slot = await admitted
    except BaseException:
        # refused (429, Redis away) or the caller gone (cancelled): nothing was queued; a
        # slot the admission took all the same is given back with its count
        others = [checked] if checked is not None else []
        got, *_ = await asyncio.gather(admitted, *others, return_exceptions=True)
        if isinstance(got, Slot):
            await services.in_flight.release(aredis, got, refund=True)
        raise
    queued = False
    try:
        job = await checked  # the job's own error is said before the served check's
        if served is not None:
            await served.judge()
        traced = trace_headers(request)  # the caller's W3C trace, if it sent one
        job_id = await run_in_threadpool(
            lambda: client.enqueue(job, rate_checked=True, idempotency_key=key, **traced)
        )
        queued = True
        wait = client.wait_async(job_id, wait_s, submitted=True, **traced)
        rec = await _unless_disconnected(request, wait)
    except BaseException:
        # a call refused before its job was queued (bad code, no worker, the store or
        # Redis away) does not count against the per-minute limit
        await services.in_flight.release(aredis, slot, refund=not queued)
        raise
    # the slot goes back as the answer goes out (not after Redis confirms it: that round
    # trip is off the call's path); the request ends once it is back
    answer = _answer(rec)
    answer.background = BackgroundTask(services.in_flight.release_now(aredis, slot))
    return answer


def _answer(rec: JobRecord | None) -> Response:
    """The test call's answer: the run (200 finished, 202 not yet), or 499 when the caller
    went away (the run goes on and GET /api/runs/{id} has it)."""
    if rec is None:
        return error_response(499, "CLIENT_GONE", "The caller went away before the result.")
    # the view serialised once, by pydantic, as FastAPI would from response_model (the
    # same bytes) without validating it again on the way out
    return Response(
        RunView.of(rec).model_dump_json(),
        status_code=200 if rec.status.finished else 202,
        media_type="application/json",
    )


async def _unless_disconnected(
    request: Request, wait: Coroutine[Any, Any, JobRecord]
) -> JobRecord | None:
    """``wait``'s result, or None as soon as the caller disconnects (the wait is cancelled,
    so the caller's in-flight slot is given back at once). What ``wait`` raises comes out
    as itself (a 503, a 404). The watch is a task of its own that cancels this one on a
    disconnect; once the wait is over it is cancelled, not waited for (nothing of it is
    left to run), so the answer does not wait a turn of the loop for it."""
    this = asyncio.current_task()
    assert this is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # noqa: BLE001 - cannot tell: keep waiting for the result
            return
        gone = True
        this.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await wait
    except asyncio.CancelledError:
        if gone and this.uncancel() == 0:  # our own cancel and nobody else's
            return None
        raise
    finally:
        watcher.cancel()
