"""Fair share of ``code.run`` between users: one user's flood never holds another user's
run behind it, and an optional cap on one user's runs in flight.

Celery stays the engine; only WHERE a workflow run's message waits changes. The API sends
the run as ever (``send_task``: kombu builds the message), with the header
``HEADER_FAIR_USER``; its broker channel (``FairChannel`` below, a part of every channel
worker.broker composes) puts that message on the user's waiting list in Redis instead of
``code.run``. A release moves messages from the users' lists into ``code.run``, in turns,
as the real Celery messages they are; from there the worker consumes, claims and
acknowledges exactly as before.

The state (keys in worker.protocol, all changed by the script worker/fair.lua and nothing
else):

* ``studio:fair:wait:<user>``: the user's waiting job ids, oldest first; the message of
  each in the hash ``studio:fair:messages``, its user in ``studio:fair:jobs``;
* ``studio:fair:users``: users with runs waiting, scored by a virtual start time (start-time
  fair queueing). A release takes the user with the lowest score, gives it one run, and
  adds 1 to its score; a user who had nothing waiting comes in at the clock (the score of
  the last turn taken), so it is served next, before every user with a backlog, and a user
  alone takes every turn;
* ``studio:fair:held`` / ``held_count``: runs released and not ended, per user. A user at
  STUDIO_QUEUE_RUN_USER_SLOTS of them is parked in ``studio:fair:capped`` until one ends;
* ``studio:fair:counts`` (runs waiting per user, for meta and /metrics) and
  ``studio:fair:backlog`` (one item per waiting run: a list an autoscaler can LLEN).

How much is released: ``code.run`` may hold as many messages as the live workers' run slots
(read from their heartbeats, ``studio:workers:code.run``), at least FAIR_MIN_AHEAD. A
worker prefetches one message per slot, so that is one message for every slot that frees,
and a run of a new user waits behind at most that many messages plus the running jobs.

Who releases: the API at submit (the script's enqueue releases in the same call, so a run
with room goes to ``code.run`` with no added latency), the pool process when a job ends
(after its result is stored, before its message is acknowledged, so the freed slot finds
the next message), and each worker's main process every FAIR_RELEASE_INTERVAL_S
(``release_loop``: workers that join, runs whose job ended elsewhere). Every release is one Lua
script, atomic in Redis: many releasers never release one run twice nor overfill
``code.run``. Cost per run: one script call at submit (instead of kombu's LPUSH), one at
its end.

Messages sent again (a retry's next attempt, worker.upkeep.retry_due; a lost message the
queued sweep sends, worker.upkeep.queued) carry ``HEADER_FAIR_AGAIN`` too and go through
``FairQueue.enqueue(again=True)``: a run that holds its slot (released, not ended) gets its
message back in its queue, counted once; a run waiting on its lane is left there; any
other waits on the lane its last attempt had (kept by ``pause`` when that attempt ended for
a retry) or on the lane of the keys the message carries (the sweeps send the user, tenant
and workflow the run store's row holds: a run whose fair state Redis lost entirely comes
back to its own lane). A message kombu restores or a worker hands back (Reject) is not
sent through a channel's ``_put``: its run keeps its slot.

Each worker group's workflow-run queue (code.run.NAME) has a fair state of its own, the
same keys under ``group_prefix``: its runs take turns and count against their caps within
the group, released up to the group's live workers' slots.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.utils.json import dumps

from executor.settings import Settings
from worker import lua
from worker.protocol import (
    DEFAULT_GROUP,
    FAIR_AGAIN_KEY,
    FAIR_BACKLOG_KEY,
    FAIR_CAPPED_KEY,
    FAIR_CLOCK_KEY,
    FAIR_COUNTS_KEY,
    FAIR_HELD_COUNT_KEY,
    FAIR_HELD_KEY,
    FAIR_JOBS_KEY,
    FAIR_MESSAGES_KEY,
    FAIR_MIN_AHEAD,
    FAIR_PARKED_KEY,
    FAIR_PARKED_KINDS_KEY,
    FAIR_PREFIX,
    FAIR_RELEASE_INTERVAL_S,
    FAIR_SEQ_KEY,
    FAIR_SEQ_NEXT_KEY,
    FAIR_USERS_KEY,
    FAIR_WAIT_PREFIX,
    HEADER_FAIR_AGAIN,
    HEADER_FAIR_TENANT,
    HEADER_FAIR_USER,
    HEADER_FAIR_WORKFLOW,
    QUEUE_RUN,
    fair_wait_key,
    group_of_queue,
    kind_of_queue,
    queue_of,
    workers_key,
)

log = logging.getLogger("studio_code.worker")

#: most runs one script call releases (the rest: the next call)
RELEASE_MAX = 500
#: users meta and /metrics rank by runs waiting
TOP_USERS = 5

#: the script's KEYS, in this order, for the default worker group (the lane lists are
#: FAIR_WAIT_PREFIX + lane; per flow and per capped key, FAIR_PREFIX + ``lanes:<flow>`` and
#: ``parked:<key>``); another group's are ``group_keys``'
KEYS = (
    QUEUE_RUN,
    workers_key(QUEUE_RUN),
    FAIR_USERS_KEY,
    FAIR_CAPPED_KEY,
    FAIR_JOBS_KEY,
    FAIR_MESSAGES_KEY,
    FAIR_HELD_KEY,
    FAIR_HELD_COUNT_KEY,
    FAIR_COUNTS_KEY,
    FAIR_CLOCK_KEY,
    FAIR_BACKLOG_KEY,
    FAIR_SEQ_KEY,
    FAIR_PARKED_KEY,
    FAIR_PARKED_KINDS_KEY,
    FAIR_SEQ_NEXT_KEY,
    FAIR_AGAIN_KEY,
)


def group_prefix(group: str | None) -> str:
    """The prefix of a worker group's fair-share keys: FAIR_PREFIX for the default group
    (its keys as they always were), ``studio:fair:g:<group>:`` for another. Each group's
    workflow runs take turns and count against their caps in that group's state alone
    (bounded: one set of keys per group, STUDIO_WORKER_GROUPS has at most MAX_GROUPS)."""
    if not group or group == DEFAULT_GROUP:
        return FAIR_PREFIX
    return f"{FAIR_PREFIX}g:{group}:"


def group_keys(group: str | None) -> tuple[str, ...]:
    """The script's KEYS for the workflow-run queue of worker group ``group``."""
    prefix = group_prefix(group)
    if prefix == FAIR_PREFIX:
        return KEYS
    queue = queue_of("run", group)
    return (
        queue,
        workers_key(queue),
        *(k.replace(FAIR_PREFIX, prefix, 1) for k in KEYS[2:]),
    )


#: the script (worker/fair.lua): one operation per call, named in its arguments (``_args``)
SCRIPT = lua.source(__package__, "fair.lua")


#: the kinds of worker/fair.lua's capped keys, by the letter it names them with
CAP_KINDS = {"u": "user", "t": "tenant", "w": "workflow"}


@dataclass(frozen=True)
class Waiting:
    """Where a run held back by fairness (or a cap of one of its keys) waits."""

    #: its share key's value (the user with STUDIO_QUEUE_RUN_SHARE_KEY=user; the tenant's
    #: or the tenant's and user's otherwise): shown to admins only
    flow: str
    #: runs of its lane (same tenant, user and workflow) ahead of it
    position: int
    #: flows whose turn comes before its flow's next one; None: a cap holds it
    users_ahead: int | None
    #: flows with runs waiting (its own included)
    users_waiting: int
    #: the kind of the key at its cap that holds it (user, tenant, workflow; None: none)
    cap_kind: str | None = None
    #: that kind's cap, and that key's runs released and not ended
    cap: int = 0
    cap_held: int = 0
    #: the workflow-run queue it goes to (its worker group's)
    queue: str = QUEUE_RUN

    @property
    def user(self) -> str:
        """The flow (the user, under the default share key)."""
        return self.flow

    @property
    def held_by(self) -> str:
        if self.cap_kind is not None:
            return f"{self.cap_kind}_cap"
        return "fairness" if self.users_ahead is not None else "user_cap"

    def as_dict(self) -> dict[str, Any]:
        return {
            "queue": self.queue,
            "held_by": self.held_by,
            "position": self.position,
            "users_ahead": self.users_ahead,
            "users_waiting": self.users_waiting,
        }


@dataclass(frozen=True)
class UserLoad:
    user: str
    waiting: int
    #: released and not ended (running or about to)
    held: int


@dataclass(frozen=True)
class FairStats:
    """Runs waiting on the users' lists, and the users with the most of them."""

    waiting: int
    users_waiting: int
    held: int
    top: tuple[UserLoad, ...]

    def as_dict(self, *, names: bool = False) -> dict[str, Any]:
        """``top`` by rank (1: the most runs waiting); each entry names its user only with
        ``names`` (an admin's view: user ids are shown to no one else)."""
        top = []
        for rank, u in enumerate(self.top, 1):
            entry: dict[str, Any] = {"rank": rank, "waiting": u.waiting, "running": u.held}
            if names:
                entry["user"] = u.user
            top.append(entry)
        return {
            "waiting": self.waiting,
            "users_waiting": self.users_waiting,
            "released_not_ended": self.held,
            "top": top,
        }


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def user_cap(settings: Settings) -> int:
    """The per-user cap the script applies (0: none; fairness off: none)."""
    return settings.queue_run_user_slots if settings.queue_run_fairness == "users" else 0


def lane_of(user: str, tenant: str = "", workflow: str = "") -> str:
    """The lane a run waits on (worker/fair.lua): the user alone when it names no tenant nor
    workflow, else the JSON array of the three."""
    if not tenant and not workflow:
        return user
    return json.dumps([tenant, user, workflow], separators=(",", ":"))


class FairQueue:
    """worker/fair.lua's operations on one Redis client. Every method raises
    redis.RedisError when Redis cannot be reached."""

    def __init__(
        self,
        client: redis.Redis,
        cap: int,
        *,
        share: str = "user",
        tenant_cap: int = 0,
        workflow_cap: int = 0,
        group: str | None = None,
    ) -> None:
        """``cap``: runs released and not ended per user, ``tenant_cap`` per tenant,
        ``workflow_cap`` per workflow (0: none); ``share``: what takes turns (user, tenant,
        tenant/user); ``group``: the worker group whose workflow-run queue this is (None:
        the default group's, code.run)."""
        self.client = client
        self.cap = cap
        self.share = share
        self.tenant_cap = tenant_cap
        self.workflow_cap = workflow_cap
        self.group = group or DEFAULT_GROUP
        self.keys = group_keys(group)
        self.prefix = group_prefix(group)
        self.wait_prefix = FAIR_WAIT_PREFIX.replace(FAIR_PREFIX, self.prefix, 1)
        self._script = client.register_script(SCRIPT)

    @classmethod
    def of(cls, client: redis.Redis, settings: Settings, group: str | None = None) -> FairQueue:
        """The queue of worker group ``group`` (None: the default group) with the share key
        and caps of ``settings`` (none when fairness is off)."""
        on = settings.queue_run_fairness == "users"
        return cls(
            client,
            user_cap(settings),
            share=settings.queue_run_share_key,
            tenant_cap=settings.queue_run_tenant_slots if on else 0,
            workflow_cap=settings.queue_run_workflow_slots if on else 0,
            group=group,
        )

    def _args(self, op: str, *more: Any) -> list[Any]:
        """The script's arguments for the operation ``op`` (worker/fair.lua's ``ops``)."""
        return [
            self.wait_prefix,
            self.cap,
            FAIR_MIN_AHEAD,
            RELEASE_MAX,
            op,
            self.share,
            self.tenant_cap,
            self.workflow_cap,
            self.prefix,
            *more,
        ]

    def _run(self, op: str, *more: Any, client: Any = None) -> Any:
        return self._script(
            keys=self.keys, args=self._args(op, *more), client=client or self.client
        )

    def enqueue(
        self,
        job_id: str,
        user: str,
        message: str,
        client: Any = None,
        *,
        tenant: str = "",
        workflow: str = "",
        again: bool = False,
    ) -> int:
        """Put a run's message on its lane (its user's, tenant's and workflow's), then
        release what has room (returns how many runs went to code.run). ``again``: a
        message sent again for a job sent before (a retry's next attempt, a lost message):
        straight to its queue when the job holds its slot (released, not ended: counted
        once), nothing when it waits on its lane, else on the lane its last attempt had
        (kept by ``pause``), or on this one."""
        lane = lane_of(user, tenant, workflow)
        op = "again" if again else "enqueue"
        return int(self._run(op, job_id, lane, message, client=client))

    def release(self) -> int:
        """Move waiting runs into code.run, in turns, while it has room."""
        return int(self._run("release"))

    def ended(self, job_ids: list[str]) -> int:
        """These jobs ended: their user's cap slots are free. Then release."""
        return int(self._run("ended", *job_ids))

    def pause(self, job_ids: list[str]) -> int:
        """These jobs' attempts ended and their next attempts wait out a retry's delay: their
        slots are free as at an end, their lanes kept for the next attempts (``enqueue``'s
        ``again``).
        Then release."""
        return int(self._run("pause", *job_ids))

    def add_ended(self, pipe: Any, job_ids: list[str], *, paused: bool = False) -> None:
        """``ended`` (``pause`` with ``paused``) added to a pipeline the job's end shares
        (EVALSHA only: a pipeline given the script object would first ask SCRIPT EXISTS, a
        round trip of its own). The reply is a NoScriptError when this Redis has not loaded
        the script yet (new, restarted, failed over): ``ended`` then loads it."""
        op = "pause" if paused else "ended"
        pipe.evalsha(self._script.sha, len(self.keys), *self.keys, *self._args(op, *job_ids))

    def forget(self, job_ids: list[str]) -> int:
        """Take runs off their users' lists (cancelled or ended while waiting there)."""
        if not job_ids:
            return 0
        return int(self._run("forget", *job_ids))

    def where(self, job_id: str) -> Waiting | None:
        """Where ``job_id`` waits, when it is on a user's list (None: it is not)."""
        reply = self._run("where", job_id)
        if not reply:
            return None
        flow, position, rank, users, kind, cap, held = reply
        cap_kind = CAP_KINDS.get(_text(kind))
        return Waiting(
            _text(flow),
            int(position),
            None if int(rank) < 0 or cap_kind else int(rank),
            int(users),
            cap_kind,
            int(cap),
            int(held),
            self.keys[0],
        )

    def stats(self, top: int = TOP_USERS) -> FairStats:
        reply = self._run("stats", max(1, top))
        waiting, users, held, *rest = reply
        loads = tuple(
            UserLoad(_text(rest[i]), int(rest[i + 1]), int(rest[i + 2]))
            for i in range(0, len(rest) - 2, 3)
        )
        return FairStats(int(waiting), int(users), int(held), loads)

    def held(self) -> dict[str, str]:
        """job id -> lane (the user, for a run naming no tenant nor workflow) of every run
        released and not ended (bounded by the runs in
        code.run and the workers' slots, plus any whose end was not seen)."""
        held = self.client.hgetall(self.keys[KEYS.index(FAIR_HELD_KEY)])
        return {_text(k): _text(v) for k, v in held.items()}

    def paused(self) -> list[str]:
        """The jobs whose lane is kept for a retry's next attempt (``pause``)."""
        return [_text(k) for k in self.client.hkeys(self.keys[KEYS.index(FAIR_AGAIN_KEY)])]

    @property
    def jobs_key(self) -> str:
        """The hash of the runs waiting on a lane (job id -> lane)."""
        return self.keys[KEYS.index(FAIR_JOBS_KEY)]

    def reconcile(self, finished: set[str]) -> int:
        """End the held runs of ``held()`` whose job the run store says ended (their
        end was not seen: the reaper failed them, a worker died after the result)."""
        return self.ended(sorted(finished)) if finished else 0


# --- the broker channel's part (worker.broker composes it) -----------------------------------

#: the broker transport options that carry the per-user cap, the share key and the other
#: caps to the channel
CAP_OPTION = "studio_fair_user_cap"
SHARE_OPTION = "studio_fair_share_key"
TENANT_CAP_OPTION = "studio_fair_tenant_cap"
WORKFLOW_CAP_OPTION = "studio_fair_workflow_cap"

if TYPE_CHECKING:
    _ChannelBase = kombu_redis.Channel
else:
    _ChannelBase = object


class FairChannel(_ChannelBase):
    """A part of kombu's Redis channels (plain and Sentinel: worker.broker composes them):
    a message for a workflow-run queue (code.run, or a worker group's code.run.NAME)
    carrying ``HEADER_FAIR_USER`` goes to its lane in that group's fair state instead (the
    message kombu built, unchanged); with ``HEADER_FAIR_AGAIN`` too (a message the workers
    send again), ``FairQueue.enqueue(again=True)`` admits it. Any other message is kombu's."""

    _fair: dict[str, FairQueue] | None = None

    def _put(self, queue: str, message: Any, **kwargs: Any) -> Any:
        headers = message.get("headers") or {}
        user = headers.get(HEADER_FAIR_USER)
        if (
            user is None
            or kind_of_queue(queue) != "run"
            or kwargs.get("_publish_batch") is not None
        ):
            return super()._put(queue, message, **kwargs)
        with self.conn_or_acquire() as client:
            if self._fair is None:
                self._fair = {}
            fair = self._fair.get(queue)
            if fair is None:
                opts = self.connection.client.transport_options
                fair = self._fair[queue] = FairQueue(
                    client,
                    int(opts.get(CAP_OPTION) or 0),
                    share=str(opts.get(SHARE_OPTION) or "user"),
                    tenant_cap=int(opts.get(TENANT_CAP_OPTION) or 0),
                    workflow_cap=int(opts.get(WORKFLOW_CAP_OPTION) or 0),
                    group=group_of_queue(queue),
                )
            fair.enqueue(
                str(headers["id"]),
                str(user),
                dumps(message),
                client=client,
                tenant=str(headers.get(HEADER_FAIR_TENANT) or ""),
                workflow=str(headers.get(HEADER_FAIR_WORKFLOW) or ""),
                again=bool(headers.get(HEADER_FAIR_AGAIN)),
            )
        return None


def fair_headers(
    settings: Settings,
    kind: str,
    user: str,
    tenant: str = "",
    workflow: str = "",
    *,
    again: bool = False,
) -> dict[str, str]:
    """The headers that send a job's message through its group's fair queue (none for a
    test call, nor with fairness off): its user, its tenant and workflow when it has them;
    ``again`` for a message the workers send again (a retry's next attempt, a lost one)."""
    if kind != "run" or settings.queue_run_fairness != "users":
        return {}
    headers = {HEADER_FAIR_USER: user}
    if tenant:
        headers[HEADER_FAIR_TENANT] = tenant
    if workflow:
        headers[HEADER_FAIR_WORKFLOW] = workflow
    if again:
        headers[HEADER_FAIR_AGAIN] = "1"
    return headers


def transport_options(settings: Settings) -> dict[str, Any]:
    """The broker transport options the channel's part reads (worker.broker adds them)."""
    on = settings.queue_run_fairness == "users"
    return {
        CAP_OPTION: user_cap(settings),
        SHARE_OPTION: settings.queue_run_share_key,
        TENANT_CAP_OPTION: settings.queue_run_tenant_slots if on else 0,
        WORKFLOW_CAP_OPTION: settings.queue_run_workflow_slots if on else 0,
    }


# --- the worker's side: releases ---------------------------------------------------------------


def release_loop(
    queue: FairQueue, interval_s: float = FAIR_RELEASE_INTERVAL_S
) -> Callable[[threading.Event], None]:
    """The body of the worker main process's release loop (worker.upkeep.owner runs it
    under ``Supervised``): a release every ``interval_s``, so runs never wait for a job end
    that does not come (a worker that joins, a run whose job ended elsewhere). Many
    workers release at once safely: each release is one script."""

    def body(stop: threading.Event) -> None:
        failing = False
        while not stop.wait(interval_s):
            try:
                queue.release()
            except redis.RedisError as e:  # Redis away: keep trying, say it once
                if not failing:
                    log.warning("fair release: cannot reach Redis (%s); retrying", e)
                failing = True
                continue
            if failing:
                log.warning("fair release: Redis answers again")
            failing = False

    return body


def job_ended(queue: FairQueue, job_id: str, *, paused: bool = False) -> None:
    """A pool process's job ended (its attempt, for a retry, with ``paused``): free its
    user's cap slot and release (never raises: the main process's releases and the sweep's
    reconcile catch up)."""
    try:
        if paused:
            queue.pause([job_id])
        else:
            queue.ended([job_id])
    except Exception as e:  # noqa: BLE001 - the job's outcome is stored; this is bookkeeping
        log.warning("job %s: fair release after its end failed (%s); the workers retry", job_id, e)


__all__ = [
    "fair_headers",
    "group_keys",
    "lane_of",
    "FairQueue",
    "FairStats",
    "FairChannel",
    "release_loop",
    "transport_options",
    "Waiting",
    "fair_wait_key",
    "job_ended",
    "user_cap",
]
