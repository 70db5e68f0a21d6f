"""What the studio's API calls: submit, wait, status, cancel, validate, meta, and editor test
calls (rate limited per user, across API processes, in Redis).

A job is one row in the run store (code, state, result) and one Celery message carrying
only its id; the Celery task id IS the job id. The run store is the truth for every
question; Redis only moves messages and makes waiting and cancelling fast.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import redis
from pydantic import BaseModel

from api_client import idempotency, waiting, why_waiting
from api_client.log_follower import LogEvent
from api_client.waiting import WAIT_SLICE_S
from api_client.why_waiting import WhyWaiting
from executor import inputs, tracing
from executor.errors import (
    CodeInvalid,
    ErrorCode,
    RateLimited,
    RuntimeUnavailable,
    StoreUnavailable,
)
from executor.groups import DEFAULT_GROUP, asks_text, choose, groups_of, widest
from executor.keys import check_key
from executor.languages.base import Problem
from executor.models import CodeJob, CodeResult, Kind, Status
from executor.retry import parse_policy
from executor.service import Executor
from executor.settings import Settings
from executor.store import (
    JobRecord,
    RunFilter,
    RunStore,
    RunSummary,
    decode_cursor,
    encode_cursor,
    open_store,
)
from worker import lua, preimport, redis_conn
from worker.cancel import CancelWatch
from worker.fair import FairQueue, Waiting, fair_headers
from worker.protocol import (
    CANCEL_SIGNAL_NAME,
    TASK_NAME,
    cancel_flag_ttl_s,
    cancel_key,
    done_key,
    group_of_queue,
    group_queues,
    job_headers,
    max_wait_s,
    never_taken_message,
    notice_key,
    queue_of,
    rate_key,
    visibility_timeout_s,
)
from worker.registry import AsyncWorkerRegistry, WorkerInfo, WorkerRegistry, summary

log = logging.getLogger("studio_code.api_client")

#: most runs one page of the history holds
RUNS_PAGE_MAX = 200

RATE_WINDOW_S = 60
BLOCK_GRACE_S = 1.0  # a BLMOVE answered this much later than its block time is given up
SERVED_CACHE_S = 1.0  # "a live worker serves this queue" is believed this long per process
#: threads of wait_async's store reads (a read takes milliseconds; a wait holds none)
WAIT_READ_THREADS = 4
#: redis.asyncio connections per API process (waiting test calls hold one each, briefly)
ASYNC_REDIS_CONNECTIONS = 1000

#: an editor test call's admission (api_client/admit.lua: the per-minute rate, and the HTTP
#: route's in-flight slot: api_client.http.inflight)
ADMIT_LUA = lua.source(__package__, "admit.lua")


def rate_limited(user: str, limit: int, wait_us: int) -> RateLimited:
    """The refusal of an editor test call over STUDIO_CODE_TEST_PER_MINUTE (``wait_us``:
    until the oldest call of the window leaves it)."""
    retry = max(1, math.ceil(wait_us / 1_000_000))
    who = f"User {user!r}" if user else "This user"
    return RateLimited(
        f"{who} made {limit} editor test calls in the last minute (the limit, "
        f"STUDIO_CODE_TEST_PER_MINUTE={limit}): try again in {retry} s.",
        retry_after_s=retry,
    )


def _slot_text(info: WorkerInfo) -> str:
    """What one slot of a live worker holds, as a refusal names it."""
    return asks_text(info.memory_bytes, info.cpus) + " per slot"


class RunPage(BaseModel):
    """One page of run history, newest first; ``next_cursor`` is None on the last page."""

    runs: list[RunSummary]
    next_cursor: str | None = None


def _aware(value: datetime | None) -> datetime | None:
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)


def _registry_unreadable(e: Exception) -> RuntimeUnavailable:
    return RuntimeUnavailable(
        f"The queue (Redis at STUDIO_REDIS_URL) cannot be read ({e}): check that "
        "Redis is up, then run it again."
    )


class JobNotFound(LookupError):
    """Raised when no job in the run store has the id asked about."""

    def __init__(self, job_id: str, store: str = "") -> None:
        where = f"the run store at {store}" if store else "the run store"
        hint = (
            (
                " and that STUDIO_DATABASE_URL (or STUDIO_DATA_DIR) points at the store it "
                "was submitted to"
            )
            if store
            else ""
        )
        super().__init__(f"No job {job_id!r} in {where}: check the id{hint}.")
        self.job_id = job_id


class CodeClient:
    """The queue's client side, one per API process (thread-safe)."""

    def __init__(
        self, settings: Settings, *, store: RunStore | None = None, create_store: bool = True
    ) -> None:
        """``create_store=False`` opens the run store for reading only: nothing is created
        (no folder, file or table), a missing SQLite file raises StoreUnavailable. An
        unreachable store raises StoreUnavailable naming it, here and in every call."""
        self.settings = settings
        self._own_store = store is None
        self.store: RunStore = (
            store if store is not None else open_store(settings.sqlalchemy_url, create=create_store)
        )
        log.info("run store: %s", self.store.describe())
        self.executor = Executor(settings, audit=self.store)
        #: the worker groups jobs go to (executor.groups), the default group first; a
        #: node's ask is checked against the widest, then against its group's
        self.groups = groups_of(settings)
        if len(self.groups) > 1:
            self.executor.caps = widest(self.groups)
        #: every group's queues, the default group's (QUEUES) first
        self.queues = tuple(q for g in self.groups for q in group_queues(g.name))
        self.redis = redis_conn.client(settings)
        self.workers = WorkerRegistry(self.redis)
        #: workflow runs wait per user and take turns (worker.fair) unless fairness is off
        self.fair_users = settings.queue_run_fairness == "users"
        #: the default group's fair queue, and every group's (worker.fair.group_keys)
        self.fair = FairQueue.of(self.redis, settings)
        self.fairs = {g.name: FairQueue.of(self.redis, settings, g.name) for g in self.groups}
        self.fairs[self.fair.group] = self.fair
        self._served_until: dict[tuple[str, int, float], float] = {}
        self._aworkers: AsyncWorkerRegistry | None = None  # on async_redis (the API's loop)
        #: the run store's id has been read (the store keeps it): the loop needs no thread
        self._store_id_known = False
        # BLMOVE blocks up to WAIT_SLICE_S: its socket must wait longer than that.
        self._blocking = redis_conn.client(settings, block_s=WAIT_SLICE_S)
        self._rate = self.redis.register_script(ADMIT_LUA)
        self._app: Any = None
        self._aredis: Any = None
        self._aredis_loop: asyncio.AbstractEventLoop | None = None
        self._readers: ThreadPoolExecutor | None = None
        self._status_reads: _StatusReads | None = None
        tracing.prepare()  # tracing on: the SDK loaded now, not on the first submit

    @property
    def app(self) -> Any:
        """The client-side Celery app (made on first use)."""
        if self._app is None:
            from worker.assembly import make_app

            # the broker layer's transport for STUDIO_REDIS_URL, as the worker's
            self._app = make_app(self.settings)
        return self._app

    # --- what may run ------------------------------------------------------------------

    def validate(
        self,
        code: str,
        language: str,
        *,
        memory: str | int | None = None,
        cpus: float | None = None,
        timeout_s: float | None = None,
        group: str | None = None,
    ) -> list[Problem]:
        """The editor's save-time check: [] when the code may be saved. Raises CodeInvalid
        for a language that is not offered, or for limits the node asks for outside their
        range (below the floors of executor/floors.py, or over the server's caps
        STUDIO_CODE_MAX_MEMORY, _MAX_CPUS, _MAX_SECONDS; with worker groups, no group
        holding them, or ``group`` unknown or too small: executor.groups), giving the range."""
        problems = self.executor.check_code(code, language)
        memory_bytes = inputs.memory_bytes(memory)
        self.executor.check_limits(memory_bytes=memory_bytes, cpus=cpus, timeout_s=timeout_s)
        # a worker group holds it (the caller's ``group``, else one by size)
        choose(self.groups, *self.ask_of(memory_bytes, cpus), group or None)
        return problems

    def validate_node(self, language: str) -> None:
        """Workflow validation of a Code node: returns when it can run here, else raises
        CodeNodesDisabled, CodeInvalid (language not offered) or RuntimeUnavailable, each
        with a sentence saying how to fix it."""
        self.executor.validate_node(language)

    def meta(self, *, fresh: bool = False, names: bool = False) -> dict[str, Any]:
        """What GET /api/meta/runtime returns (and ``studio-code meta`` prints). ``names``:
        the admin's view, where ``fairness.top`` names its users (else ranks only)."""
        from executor.meta import runtime_meta

        meta = runtime_meta(self.executor, fresh=fresh)
        meta["store"] = self.store_info()
        try:
            live = self.live_workers()
            meta["workers"] = summary(live)
            # each worker's engine, as its heartbeat announces it (None: it has none, or an
            # older worker that does not announce it)
            meta["engine"]["workers"] = {i.nodename: i.engine for q in live.values() for i in q}
            # what the workers' pre-started sandboxes pre-import and hold, from their heartbeats
            meta["preimport"] = preimport.summary(live, self.settings.languages)
            meta["groups"] = self.groups_view(live)
        except redis.RedisError as e:
            meta["groups"] = {"error": f"Redis at STUDIO_REDIS_URL cannot be read: {e}"}
            meta["workers"] = {"error": f"Redis at STUDIO_REDIS_URL cannot be read: {e}"}
            meta["preimport"] = {"languages": {}, "workers": {}, "error": meta["workers"]["error"]}
        meta["fairness"] = self.fairness(names=names)
        return meta

    def fairness(self, *, names: bool = False) -> dict[str, Any]:
        """How code.run is shared (STUDIO_QUEUE_RUN_FAIRNESS, _USER_SLOTS, _SHARE_KEY,
        _TENANT_SLOTS, _WORKFLOW_SLOTS) and the runs waiting on the lanes: how many, and the
        share-key values with the most (by rank; their ids only with ``names``)."""
        out: dict[str, Any] = {
            "mode": self.settings.queue_run_fairness,
            "user_slots": self.settings.queue_run_user_slots or None,
            "share_key": self.settings.queue_run_share_key,
            "tenant_slots": self.settings.queue_run_tenant_slots or None,
            "workflow_slots": self.settings.queue_run_workflow_slots or None,
        }
        try:
            out.update(self.fair.stats().as_dict(names=names))
        except redis.RedisError as e:
            out["error"] = f"Redis at STUDIO_REDIS_URL cannot be read: {e}"
        return out

    def why_waiting(self, rec: JobRecord) -> WhyWaiting | None:
        """Why ``rec``, a queued run or test call, waits (api_client.why_waiting): no live
        worker, paused workers, its user's cap or turn, its place in its queue, with an
        estimate from the queue's recent pace. None for a job not queued, or when Redis
        cannot be read (logged)."""
        if rec.status is not Status.QUEUED:
            return None
        queue = queue_of(rec.kind, rec.worker_group)
        try:
            infos = self.workers.live([queue])[queue]
            fair = self.fair_of(rec.worker_group).where(rec.job_id) if rec.kind == "run" else None
            return why_waiting.explain(
                queue=queue,
                job_id=rec.job_id,
                infos=infos,
                store_id=self.store.store_id,
                fair=fair,
                position=lambda: why_waiting.queue_position(self.redis, queue, rec.job_id),
                done_lately=lambda: self.store.finished_since(rec.kind, why_waiting.since_window()),
                not_before_ts=rec.not_before_ts,
                retry_sent=rec.retry_sent,
            )
        except redis.RedisError as e:
            log.warning("why job %s waits is unknown (%s)", rec.job_id, e)
            return None

    def fair_of(self, group: str | None) -> FairQueue:
        """The fair queue of worker group ``group``'s workflow runs (None: the default's)."""
        return self.fairs.get(group or self.fair.group) or FairQueue.of(
            self.redis, self.settings, group
        )

    def where(self, job_id: str) -> Waiting | None:
        """Where a queued workflow run waits when fairness or its user's cap holds it back
        (None: it is not on a user's list, e.g. it is in code.run for the next free slot,
        or Redis cannot be read)."""
        try:
            return self.fair.where(job_id)
        except redis.RedisError as e:
            log.warning("where job %s waits is unknown (%s)", job_id, e)
            return None

    def store_info(self) -> dict[str, str | None]:
        """The run store this client uses: its URL (no password) and its id (None while it
        cannot be read)."""
        try:
            store_id: str | None = self.store.store_id
        except StoreUnavailable:
            store_id = None
        return {"url": self.store.describe(), "id": store_id}

    def live_workers(self) -> dict[str, list[WorkerInfo]]:
        """The workers announced on each queue of every worker group now (one Redis round
        trip; paused ones included). Raises redis.RedisError."""
        return self.workers.live(self.queues)

    def groups_view(self, live: dict[str, list[WorkerInfo]]) -> dict[str, Any]:
        """What meta shows of the worker groups (executor.groups): each group's slot (what
        this API routes by), its queues, and its live workers with what their slots hold."""
        out: dict[str, Any] = {}
        for g in self.groups:
            queues = group_queues(g.name)
            workers: dict[str, dict[str, Any]] = {}
            for q in queues:
                for i in live.get(q, []):
                    w = workers.setdefault(
                        i.nodename,
                        {
                            "memory_bytes": i.memory_bytes or None,
                            "cpus": i.cpus or None,
                            "slots": {},
                            "state": i.state,
                        },
                    )
                    w["slots"][q] = i.slots
                    if not i.serving:
                        w["state"] = i.state
            out[g.name] = {
                "memory_bytes": g.memory_bytes,
                "cpus": g.cpus,
                "queues": list(queues),
                "workers": workers,
            }
        return out

    def ask_of(self, memory_bytes: int | None, cpus: float | None) -> tuple[int, float]:
        """What a job asks of a slot: its memory and CPU share (none: the defaults,
        STUDIO_CODE_MEMORY / STUDIO_CODE_CPUS)."""
        s = self.settings
        return (memory_bytes or s.memory_bytes, cpus or s.code_cpus)

    @staticmethod
    def _asked(memory_bytes: int | None, cpus: float | None) -> tuple[int, float]:
        """What a job asks of a live worker's slot: only what it names (0: nothing, so
        the worker's own STUDIO_CODE_MEMORY / _CPUS, which any slot holds)."""
        return (memory_bytes or 0, cpus or 0.0)

    def test_queue_hint(
        self, memory: str | int | None, cpus: float | None, group: str | None
    ) -> tuple[str, tuple[int, float] | None]:
        """The test queue and ask an editor test call's body points at (its group, given or
        by size), for the live-worker check the HTTP route sends before the job is checked.
        Never raises: a body the check refuses points at the default group's queue (the
        job's own error is said first)."""
        try:
            memory_bytes = inputs.memory_bytes(memory)
            chosen = choose(self.groups, *self.ask_of(memory_bytes, cpus), group or None)
            return queue_of("test", chosen.name), self._asked(memory_bytes, cpus)
        except Exception:  # noqa: BLE001 - prepare() says what is wrong with the body
            return queue_of("test"), None

    def _check_served(self, queue: str, ask: tuple[int, float] | None = None) -> None:
        """Refuse at once a job no live worker would take (STUDIO_QUEUE_REQUIRE_WORKER):
        none serves ``queue`` (its worker group's), or none whose slot holds ``ask`` (the
        memory and CPU share it names: ``_asked``). A yes is believed for SERVED_CACHE_S;
        a no is asked again each time."""
        if not self._served_asked(queue, ask):
            return
        try:
            live: Any = self.workers.live([queue])
        except redis.RedisError as e:
            live = e
        self._judge_served(queue, live, ask)

    async def check_served_async(self, queue: str, ask: tuple[int, float] | None = None) -> None:
        """``_check_served`` on the event loop (redis.asyncio), so the HTTP test call asks
        it beside its admission instead of after it, in the submit's thread: a yes it finds
        is what that submit then believes (SERVED_CACHE_S)."""
        check = self.served_check(queue, ask)
        if check is not None:
            await check.judge()

    def served_check(self, queue: str, ask: tuple[int, float] | None = None) -> ServedCheck | None:
        """``check_served_async`` in two halves, for a caller that sends the registry read
        in one pipeline with its own commands (the HTTP test call: with its admission, one
        round trip): None when a yes is believed (nothing to read)."""
        if not self._served_asked(queue, ask):
            return None
        aredis = self.async_redis
        registry = self._aworkers
        if registry is None or registry.client is not aredis:
            registry = self._aworkers = AsyncWorkerRegistry(aredis)
        return ServedCheck(self, registry, queue, ask)

    def _served_asked(self, queue: str, ask: tuple[int, float] | None = None) -> bool:
        """Whether a job of ``queue`` asking ``ask`` needs the registry read now (not
        believed)."""
        if not self.settings.queue_require_worker:
            return False
        return self._served_until.get((queue, *(ask or (0, 0.0))), 0.0) <= time.monotonic()

    def _judge_served(
        self,
        queue: str,
        live: dict[str, list[WorkerInfo]] | redis.RedisError,
        ask: tuple[int, float] | None = None,
    ) -> None:
        """The answer of both checks, from what their registry read gave (the live
        workers, or the error Redis raised): returns (a yes, believed SERVED_CACHE_S) or
        raises RuntimeUnavailable saying why no job of ``queue`` asking ``ask`` would be
        taken (naming its worker group and what it asks, for a group's queue or a job no
        live worker's slot holds)."""
        if isinstance(live, redis.RedisError):
            raise _registry_unreadable(live) from live
        infos = live[queue]
        mine = self.store.store_id
        live_serving = [i for i in infos if i.serving]
        serving = [i for i in live_serving if ask is None or i.holds(*ask)]
        elsewhere = [i for i in serving if i.store_id and mine and i.store_id != mine]
        if len(serving) > len(elsewhere):
            self._served_until[(queue, *(ask or (0, 0.0)))] = time.monotonic() + SERVED_CACHE_S
            return
        group = group_of_queue(queue)
        asks = f" (the job asks {asks_text(*self.ask_of(*ask))})" if ask is not None else ""
        if group == DEFAULT_GROUP and len(live_serving) == len(serving):
            message = f"No worker is serving {queue}: start one with `studio-code worker`"
        elif len(live_serving) > len(serving):
            small = [i for i in live_serving if i not in serving]
            message = (
                f"No live worker of group {group!r} holds this job{asks}: its worker(s) "
                + ", ".join(f"{i.nodename} ({_slot_text(i)})" for i in small)
                + " hold less per slot. Start one whose STUDIO_CODE_MAX_MEMORY and "
                f"STUDIO_CODE_MAX_CPUS hold it, with `studio-code worker --group {group}`"
            )
        else:
            message = (
                f"No live worker of group {group!r} is serving {queue}{asks}: start one "
                f"with `studio-code worker --group {group}` (STUDIO_WORKER_GROUP={group})"
            )
        paused = [i for i in infos if not i.serving]
        if elsewhere:
            w = elsewhere[0]
            message += (
                f". The worker(s) {', '.join(i.nodename for i in elsewhere)} serve it from "
                f"ANOTHER run store ({w.store or '?'}, store id {w.store_id}) than this "
                f"API's ({self.store.describe()}, store id {mine}): give the API and the "
                "workers the same STUDIO_DATABASE_URL (or STUDIO_DATA_DIR)"
            )
        if paused:
            message += ". Paused: " + "; ".join(f"{i.nodename} ({i.reason})" for i in paused)
        raise RuntimeUnavailable(message + ".")

    def _job(
        self,
        code: str,
        language: str,
        state: Any,
        timeout_s: float | None,
        user: str,
        kind: str,
        memory: str | int | None = None,
        cpus: float | None = None,
        retry: Any = None,
        group: str | None = None,
        *,
        tenant: str | None = None,
        workflow: str | None = None,
    ) -> CodeJob:
        if kind not in ("run", "test"):
            raise CodeInvalid(
                f"kind={kind!r} is not a kind of call: use 'run' (a workflow "
                "run) or 'test' (an editor test call)."
            )
        timeout = inputs.timeout_s(timeout_s, max_seconds=self.settings.code_max_seconds)
        offered = self.executor.language(language)  # not offered: CodeInvalid before the rest
        state_json = inputs.state_json(state, max_bytes=self.settings.code_state_max_bytes)
        job = CodeJob(
            language=language,  # type: ignore[arg-type]  # offered, checked above
            code=code,
            state_json=state_json,
            timeout_s=timeout,  # capped now, stored so
            kind=kind,  # type: ignore[arg-type]
            user=user,
            memory_bytes=inputs.memory_bytes(memory),
            cpus=cpus,
            # the node's own policy, else the server's default (STUDIO_CODE_RETRY)
            retry=parse_policy(retry) if retry is not None else self.settings.retry_policy,
            tenant=check_key("tenant", tenant),
            workflow=check_key("workflow", workflow),
        )
        self.executor.check_job(job, language=offered, state_checked=True)
        # its worker group: the caller's, else by size (executor.groups: CodeInvalid
        # naming the groups when the asked one is unknown or too small, or none holds it)
        chosen = choose(self.groups, *self.ask_of(job.memory_bytes, job.cpus), group or None)
        if chosen.name != DEFAULT_GROUP:
            job = job.model_copy(update={"worker_group": chosen.name})
        return job

    # --- the queue ---------------------------------------------------------------------

    def submit(
        self,
        code: str,
        language: str = "python",
        state: Any = None,
        timeout_s: float | None = None,
        user: str = "",
        kind: Kind = "run",
        *,
        memory: str | int | None = None,
        cpus: float | None = None,
        rate_checked: bool = False,
        traceparent: str | None = None,
        tracestate: str | None = None,
        idempotency_key: str | None = None,
        retry: Any = None,
        group: str | None = None,
        tenant: str | None = None,
        workflow: str | None = None,
    ) -> str:
        """Queue one Code-node call; returns its job id.

        ``state`` is any JSON-serialisable value, or JSON text (str/bytes). Raises
        CodeNodesDisabled, CodeInvalid (the save-time check, a bad state, a bad kind),
        RateLimited (an editor test call over STUDIO_CODE_TEST_PER_MINUTE) or
        RuntimeUnavailable (no live worker serves the job's queue: nothing is stored; the
        run store is unreachable: StoreUnavailable naming it; Redis could not take the job:
        the job then ends failed). ``memory`` (a size such as 512m, or bytes) and ``cpus``
        are what the node asks for, from their floors (executor/floors.py) up
        to STUDIO_CODE_MAX_MEMORY / STUDIO_CODE_MAX_CPUS (outside: CodeInvalid).
        ``rate_checked``: the caller has counted this test call against
        STUDIO_CODE_TEST_PER_MINUTE already (the HTTP route, with its in-flight slot, in one
        round trip: api_client.http.inflight). ``traceparent`` (W3C, with its
        ``tracestate``): the caller's trace, which the job's spans join when tracing is on
        (executor.tracing; an unreadable one starts a trace of its own).
        ``idempotency_key``: the caller's key for this submit (api_client.idempotency): a
        repeat with the same key and request, by the same user, within
        STUDIO_IDEMPOTENCY_TTL_S, returns the first job's id and queues nothing; the same key
        with another request raises IdempotencyConflict naming the first job. ``retry``:
        the node's retry policy (executor.retry: a dict, its JSON text or a RetryPolicy;
        None: the server's STUDIO_CODE_RETRY, off by default); an outcome that is never
        retried, or a bound passed, raises CodeInvalid naming what is allowed. ``group``: the
        worker group to run on (executor.groups; None: chosen by size, the default group
        when it holds ``memory`` and ``cpus``); a group unknown or too small for them raises
        CodeInvalid, one with no live worker that holds the job RuntimeUnavailable naming
        the group and what the job asks. ``tenant`` and ``workflow``: the run's concurrency
        keys (worker.fair: the share key and the caps STUDIO_QUEUE_RUN_SHARE_KEY,
        _TENANT_SLOTS, _WORKFLOW_SLOTS); a key that is not one (executor.keys.check_key)
        raises CodeInvalid."""
        with tracing.submitting(traceparent, tracestate):
            job = self.prepare(
                code,
                language,
                state,
                timeout_s,
                user,
                kind,
                memory=memory,
                cpus=cpus,
                retry=retry,
                group=group,
                tenant=tenant,
                workflow=workflow,
            )
            return self._enqueue(job, rate_checked, idempotency_key)

    def prepare(
        self,
        code: str,
        language: str = "python",
        state: Any = None,
        timeout_s: float | None = None,
        user: str = "",
        kind: Kind = "run",
        *,
        memory: str | int | None = None,
        cpus: float | None = None,
        retry: Any = None,
        group: str | None = None,
        tenant: str | None = None,
        workflow: str | None = None,
    ) -> CodeJob:
        """What ``submit`` checks before it asks Redis or the store anything, as the job it
        would queue: raises CodeNodesDisabled or CodeInvalid as ``submit`` does. No I/O:
        the HTTP test call runs it on the event loop while its admission is on the wire,
        then queues the job with ``enqueue``."""
        return self._job(
            code,
            language,
            state,
            timeout_s,
            user,
            kind,
            memory,
            cpus,
            retry,
            group,
            tenant=tenant,
            workflow=workflow,
        )

    def enqueue(
        self,
        job: CodeJob,
        *,
        rate_checked: bool = False,
        traceparent: str | None = None,
        tracestate: str | None = None,
        idempotency_key: str | None = None,
    ) -> str:
        """The rest of ``submit`` for a job ``prepare`` made: the key's first job (when
        ``idempotency_key`` names one), the live-worker check, the editor test call's rate
        check (unless ``rate_checked``), the stored row, the message. Raises as ``submit``
        does after its checks of the job."""
        with tracing.submitting(traceparent, tracestate):
            return self._enqueue(job, rate_checked, idempotency_key)

    def first_of_key(self, job: CodeJob, idempotency_key: str) -> str | None:
        """The job an earlier submit of the same request made with this key (its id), None
        when the key names no live job; raises IdempotencyConflict when it names a job of
        another request, CodeInvalid for a key that is not one. One read of the run store."""
        keyed = idempotency.Keyed.of(job, idempotency_key, self.settings.idempotency_ttl_s)
        found = self.store.find_key(job.user, keyed.key_hash)
        return None if found is None else keyed.first_job(found)

    def _enqueue(self, job: CodeJob, rate_checked: bool, key: str | None = None) -> str:
        kind, user = job.kind, job.user
        keyed = None
        if key is not None:
            # a repeat gets its first job before any other check: it queues nothing, so
            # neither a worker nor the per-minute count is asked
            keyed = idempotency.Keyed.of(job, key, self.settings.idempotency_ttl_s)
            found = self.store.find_key(user, keyed.key_hash)
            if found is not None:
                return keyed.first_job(found)
        queue = queue_of(kind, job.worker_group)  # its worker group's (executor.groups)
        # before the row: a refused job leaves nothing queued
        self._check_served(queue, self._asked(job.memory_bytes, job.cpus))
        if kind == "test" and not rate_checked:
            self._check_rate(user)
        if keyed is None:
            self.store.create(job, code_runtime=self.settings.code_runtime)
        else:
            made = self.store.create_keyed(
                job,
                code_runtime=self.settings.code_runtime,
                key_hash=keyed.key_hash,
                request_hash=keyed.request_hash,
                expires_at=keyed.expires_at,
            )
            if not made.created:  # a concurrent repeat stored its job first: that one runs
                return keyed.first_job(made)
        headers = job_headers(self.store.store_id, self.store.describe())
        # a workflow run (of any group): the broker channel puts it on its lane in its
        # group's fair queue (worker.fair.FairChannel)
        headers.update(fair_headers(self.settings, kind, user, job.tenant, job.workflow))
        tracing.message_headers(headers, job, self.settings.code_runtime)  # when traced
        try:
            self.app.send_task(
                TASK_NAME,
                args=(job.job_id,),
                task_id=job.job_id,
                queue=queue,
                ignore_result=True,
                headers=headers,
            )
        except Exception as e:
            message = (
                f"The queue (Redis at STUDIO_REDIS_URL) did not take the job: {e}. "
                "Check that Redis is up, then run it again."
            )
            self.store.finish(
                self._ended(job, Status.FAILED, ErrorCode.RUNTIME_UNAVAILABLE, message),
                worker="api",
            )
            raise RuntimeUnavailable(message) from e
        return job.job_id

    def status(self, job_id: str) -> JobRecord:
        """The job as the run store holds it, without its code and state (``store.get``
        reads those); raises JobNotFound. A job still queued past
        its queue's bound (STUDIO_QUEUE_*_MAX_WAIT_S), or one a worker on another run store
        received (its notice in Redis), is ended failed here, so it never waits forever
        even when no worker is left to sweep."""
        rec = self.store.get(job_id, inputs=False)
        if rec is None:
            raise JobNotFound(job_id, self.store.describe())
        if rec.status is Status.QUEUED:
            rec = self._settle(rec)
        return rec

    def _settle(self, rec: JobRecord) -> JobRecord:
        queue = queue_of(rec.kind, rec.worker_group)
        bound = max_wait_s(self.settings, queue)
        message = None
        if bound > 0 and time.time() - rec.queued_at.timestamp() > bound:
            message = never_taken_message(self.settings, queue)
        else:
            try:
                raw = self.redis.get(notice_key(rec.job_id))
            except redis.RedisError:
                raw = None
            if raw:
                try:
                    message = str(json.loads(raw)["message"])
                except (ValueError, KeyError, TypeError):
                    message = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        if message is None:
            return rec
        if self.store.fail_queued([rec.job_id], message):
            log.warning("job %s ended failed while queued: %s", rec.job_id, message)
            self._forget(rec.job_id)
        return self.store.get(rec.job_id, inputs=False) or rec

    def wait(
        self,
        job_id: str,
        timeout_s: float | None = None,
        *,
        submitted: bool = False,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> JobRecord:
        """``_wait``; given the caller's ``traceparent``, in a span of its trace (when
        tracing is on)."""
        with tracing.waiting(job_id, traceparent, tracestate) as span:
            return tracing.waited(span, self._wait(job_id, timeout_s, submitted=submitted))

    def _wait(
        self, job_id: str, timeout_s: float | None = None, *, submitted: bool = False
    ) -> JobRecord:
        """The job once it has finished, or as it is after ``timeout_s`` (check
        ``.finished``). Default timeout: the queue's visibility timeout. Wakes on the
        worker's done notice (BLMOVE, which leaves it for other waiters), which carries the
        finished record when it is short (then the store is not read again), and re-reads
        the job's status at least every second (api_client.waiting decides; this thread
        does the I/O).

        ``submitted=True``: the caller has just submitted the job, so it is queued and its
        end leaves a done notice (kept DONE_TTL_S) that BLMOVE finds even if it came first:
        the wait starts on the notice, without the first status read."""
        if timeout_s is None:
            timeout_s = visibility_timeout_s(self.settings)
        steps = waiting.plan(timeout_s, submitted=submitted)
        key = done_key(job_id)
        seen: Any = None
        while True:
            try:
                step = steps.send(seen)
            except StopIteration as end:
                return end.value  # type: ignore[no-any-return]
            if step is waiting.READ_RECORD:
                seen = self.status(job_id)
            elif step is waiting.READ_STATUS:
                seen = self.store.statuses([job_id]).get(job_id)
            elif isinstance(step, waiting.Pause):
                time.sleep(step.seconds)
                seen = None
            elif isinstance(step, waiting.Block):
                if step.pause_s > 0:
                    time.sleep(step.pause_s)
                try:
                    # Redis >= 6 takes a fractional timeout
                    seen = self._blocking.blmove(
                        key,
                        key,
                        step.block_s,  # type: ignore[arg-type]
                        "LEFT",
                        "RIGHT",
                    )
                except redis.RedisError:
                    seen = waiting.REDIS_FAILED

    @property
    def async_redis(self) -> Any:
        """A redis.asyncio client for the running event loop (made on first use in it)."""
        loop = asyncio.get_running_loop()
        if self._aredis is None or self._aredis_loop is not loop:
            # Each waiting call holds a connection for its BLMOVE (at most WAIT_SLICE_S, so
            # its socket must wait longer than that; so does a live-log follower's XREAD).
            # Past ASYNC_REDIS_CONNECTIONS waiters, a wait waits for a free connection
            # instead of failing.
            self._aredis = redis_conn.async_client(
                self.settings,
                block_s=WAIT_SLICE_S,
                max_connections=ASYNC_REDIS_CONNECTIONS,
                pool_timeout_s=20,
            )
            self._aredis_loop = loop
        return self._aredis

    async def wait_async(
        self,
        job_id: str,
        timeout_s: float | None = None,
        *,
        submitted: bool = False,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> JobRecord:
        """``_wait_async``; given the caller's ``traceparent``, in a span of its trace."""
        with tracing.waiting(job_id, traceparent, tracestate) as span:
            rec = await self._wait_async(job_id, timeout_s, submitted=submitted)
            return tracing.waited(span, rec)  # type: ignore[no-any-return]

    async def _wait_async(
        self, job_id: str, timeout_s: float | None = None, *, submitted: bool = False
    ) -> JobRecord:
        """``wait`` for an event loop (the same decision, api_client.waiting): holds no
        thread while it waits. BLMOVE on the done notice through redis.asyncio; the status
        re-reads of every waiting call of this process are coalesced into one small query
        (status only: no code, state or output) on one of WAIT_READ_THREADS threads of their
        own, so waits never take the threads sync routes run on; a whole record is read on
        those threads too. ``submitted``: as for ``wait``."""
        if timeout_s is None:
            timeout_s = visibility_timeout_s(self.settings)
        loop = asyncio.get_running_loop()
        if self._readers is None:
            self._readers = ThreadPoolExecutor(WAIT_READ_THREADS, "studio-wait-read")
        reads = self._status_reads
        if reads is None or reads.loop is not loop:
            reads = self._status_reads = _StatusReads(self.store, self._readers, loop)
        aredis = self.async_redis
        steps = waiting.plan(timeout_s, submitted=submitted)
        key = done_key(job_id)
        seen: Any = None
        while True:
            try:
                step = steps.send(seen)
            except StopIteration as end:
                return end.value  # type: ignore[no-any-return]
            if step is waiting.READ_RECORD:
                seen = await loop.run_in_executor(self._readers, self.status, job_id)
            elif step is waiting.READ_STATUS:
                seen = await reads.get(job_id)
            elif isinstance(step, waiting.Pause):
                await asyncio.sleep(step.seconds)
                seen = None
            elif isinstance(step, waiting.Block):
                if step.pause_s > 0:
                    await asyncio.sleep(step.pause_s)
                try:
                    # A silent connection must not hold the wait past its own deadline (its
                    # socket timeout is STUDIO_REDIS_DEAD_AFTER_S): the store is re-read on
                    # time.
                    async with asyncio.timeout(step.block_s + BLOCK_GRACE_S):
                        seen = await aredis.blmove(key, key, step.block_s, "LEFT", "RIGHT")
                except (redis.RedisError, TimeoutError):
                    seen = waiting.REDIS_FAILED

    async def aclose(self) -> None:
        """Close what the event loop side opened (the sync side: ``close``)."""
        aredis, self._aredis = self._aredis, None
        if aredis is not None:
            await aredis.aclose()

    def list_runs(
        self,
        *,
        user: str | None = None,
        status: Iterable[Status | str] | None = None,
        language: str | None = None,
        code_runtime: str | None = None,
        kind: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> RunPage:
        """Run history, newest first: summaries (no code, state, output or logs) matching
        every filter given, at most ``limit`` (1..RUNS_PAGE_MAX) per page. Pass the page's
        ``next_cursor`` back as ``cursor`` for the next one (None: no more). Naive datetimes
        are UTC. Raises ValueError for a bad filter or cursor, with the reason."""
        if not 1 <= int(limit) <= RUNS_PAGE_MAX:
            raise ValueError(f"limit={limit} is out of range: give 1 to {RUNS_PAGE_MAX}.")
        try:
            statuses = tuple(Status(s) for s in status) if status else None
        except ValueError:
            raise ValueError(
                f"status={list(status or [])!r} has an unknown value: use "
                f"{', '.join(s.value for s in Status)}."
            ) from None
        where = RunFilter(
            user=user,
            status=statuses,
            language=language,  # type: ignore[arg-type]
            code_runtime=code_runtime,
            kind=kind,  # type: ignore[arg-type]
            since=_aware(since),
            until=_aware(until),
        )
        before = decode_cursor(cursor) if cursor else None
        rows = self.store.list_runs(where, limit=int(limit) + 1, before=before)
        more = len(rows) > limit
        rows = rows[:limit]
        return RunPage(runs=rows, next_cursor=encode_cursor(rows[-1]) if more else None)

    def follow_logs(self, job_id: str, *, timeout_s: float = 3600.0) -> Iterator[LogEvent]:
        """What job ``job_id`` prints, as it prints it (``LogEvent``: log, truncated, rerun,
        end), until the job has finished; raises JobNotFound. See api_client.log_follower."""
        from api_client.log_follower import follow

        self.status(job_id)  # JobNotFound before anything is yielded
        yield from follow(
            self._blocking,
            job_id,
            lambda: self.store.get_summary(job_id),
            lambda: self.store.get(job_id, inputs=False),
            timeout_s=timeout_s,
        )

    def cancel(self, job_id: str) -> Status:
        """Cancel a job: the intent goes to the run store FIRST (a queued job is cancelled
        at once and never starts), then the Redis flag the running job polls, then the
        revoke. Returns the job's status after the call (a finished job is unchanged);
        raises JobNotFound."""
        status = self.store.request_cancel(job_id)
        if status is None:
            raise JobNotFound(job_id, self.store.describe())
        if status not in (Status.CANCELLING, Status.CANCELLED):
            return status  # it ended before the cancel
        if status is Status.CANCELLED:  # it was queued: off its user's list, if it waits there
            self._forget(job_id)
        try:
            self.redis.set(cancel_key(job_id), "1", ex=cancel_flag_ttl_s(self.settings))
        except redis.RedisError as e:
            log.warning("cancel flag of %s not set (%s): the worker reads the run store", job_id, e)
        try:
            self.app.control.revoke(job_id, terminate=True, signal=CANCEL_SIGNAL_NAME)
        except Exception as e:  # noqa: BLE001 - the flag and the store still stop it
            log.warning("revoke of %s not sent (%s): the worker polls its cancel flag", job_id, e)
        return status

    # --- editor test calls ---------------------------------------------------------------

    def _check_rate(self, user: str) -> None:
        limit = self.settings.code_test_per_minute
        try:
            admitted, wait_us = self._rate(
                keys=[rate_key(user)],
                args=[limit, RATE_WINDOW_S * 1_000_000, uuid.uuid4().hex],
            )
        except redis.RedisError as e:
            raise RuntimeUnavailable(
                f"Redis at STUDIO_REDIS_URL cannot count editor test calls ({e}): check that "
                "it is up."
            ) from e
        if not admitted:
            raise rate_limited(user, limit, int(wait_us))

    def run_inline(
        self,
        code: str,
        language: str = "python",
        state: Any = None,
        timeout_s: float | None = None,
        user: str = "",
        kind: Kind = "test",
    ) -> CodeResult:
        """Run a call in THIS process, no queue (an API that runs editor test calls itself).
        Same checks and rate limit as submit; the job is in the run store, so status and
        cancel work on it. At most STUDIO_CODE_CONCURRENCY sandboxes run at once per process
        (the executor's semaphore); more calls wait for a slot."""
        job = self._job(code, language, state, timeout_s, user, kind)
        if kind == "test":
            self._check_rate(user)
        self.store.create(job, code_runtime=self.settings.code_runtime)
        worker = f"inline@{socket.gethostname()}:{os.getpid()}"
        rec = self.store.claim(job.job_id, worker)
        if rec is not None:
            watch = CancelWatch(job.job_id, store=self.store, client=self.redis)
            result = self.executor.run(job, should_cancel=watch)
            self.store.finish(result, worker=worker)
        final = self.status(job.job_id).to_result()
        assert final is not None
        return final

    # --- helpers -------------------------------------------------------------------------

    def _forget(self, job_id: str) -> None:
        """Take an ended job off its user's waiting list (if it is on one). Best effort:
        a run left there is released later and skipped by claim, never started."""
        try:
            for fair in self.fairs.values():  # a few groups at most (MAX_GROUPS)
                fair.forget([job_id])
        except redis.RedisError as e:
            log.warning("job %s stays on its user's waiting list (%s): claim skips it", job_id, e)

    def _ended(self, job: CodeJob, status: Status, code: ErrorCode, message: str) -> CodeResult:
        return CodeResult.ended(
            job.job_id, job.language, status, code, message, runtime=self.settings.code_runtime
        )

    def close(self) -> None:
        if self._app is not None:
            self._app.close()
            self._app = None
        self.redis.close()
        self._blocking.close()
        if self._readers is not None:
            self._readers.shutdown(wait=False)
        if self._own_store:
            self.store.close()

    def __enter__(self) -> CodeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ServedCheck:
    """One live-worker check on the event loop (``CodeClient.served_check``): ``add`` puts
    its registry read in a pipeline and the caller sets ``reply`` to what that read
    answered (its reply, or the redis.RedisError it raised); ``judge`` then returns or
    raises as ``check_served_async`` does. Without a reply (or NoScriptError) ``judge``
    reads the registry itself."""

    def __init__(
        self,
        client: CodeClient,
        registry: AsyncWorkerRegistry,
        queue: str,
        ask: tuple[int, float] | None,
    ) -> None:
        self.client, self.registry, self.queue, self.ask = client, registry, queue, ask
        self.reply: Any = None
        self._names = [queue]

    def add(self, pipe: Any) -> None:
        self._names = self.registry.add_live(pipe, [self.queue])

    async def judge(self) -> None:
        client, reply = self.client, self.reply
        live: Any
        if reply is None or isinstance(reply, redis.exceptions.NoScriptError):
            try:
                live = await self.registry.live([self.queue])
            except redis.RedisError as e:
                live = e
        elif isinstance(reply, redis.RedisError):
            live = reply
        else:
            live = self.registry.parse_live(self._names, reply)
        if not isinstance(live, redis.RedisError) and not client._store_id_known:
            # the judge compares store ids: this API's is read (once, then kept) off the
            # loop, as the sync check reads it in the submit's thread; once known, no
            # thread hop (each one costs the call a wake-up of a pool thread and back)
            await asyncio.to_thread(lambda: client.store.store_id)
            client._store_id_known = True
        client._judge_served(self.queue, live, self.ask)


class _StatusReads:
    """Coalesces the status re-reads of every waiting call into one query per window: 200
    waiting calls cost a few small queries a second, not 200 record loads."""

    WINDOW_S = 0.02

    def __init__(
        self, store: RunStore, threads: ThreadPoolExecutor, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.store, self.threads, self.loop = store, threads, loop
        self._pending: dict[str, list[asyncio.Future[Status | None]]] = {}
        self._flush: asyncio.Task[None] | None = None

    async def get(self, job_id: str) -> Status | None:
        """The job's status (None when the store does not know it)."""
        future: asyncio.Future[Status | None] = self.loop.create_future()
        self._pending.setdefault(job_id, []).append(future)
        if self._flush is None:
            self._flush = self.loop.create_task(self._read())
        return await future

    async def _read(self) -> None:
        await asyncio.sleep(self.WINDOW_S)
        batch, self._pending, self._flush = self._pending, {}, None
        try:
            found = await self.loop.run_in_executor(self.threads, self.store.statuses, list(batch))
        except Exception as e:  # noqa: BLE001 - each waiter gets it, as its own read would
            for futures in batch.values():
                for f in futures:
                    if not f.done():
                        f.set_exception(e)
            return
        for job_id, futures in batch.items():
            for f in futures:
                if not f.done():
                    f.set_result(found.get(job_id))
