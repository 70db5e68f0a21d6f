"""Fair share of ``code.run`` between users: one user's flood never holds another user's
run behind it, and an optional cap on one user's runs in flight.

Celery stays the engine; only WHERE a workflow run's message waits changes. The API sends
the run as ever (``send_task``: kombu builds the message), with the header
``HEADER_FAIR_USER``; its broker channel (``FairChannel`` below, a part of every channel
worker.broker composes) puts that message on the user's waiting list in Redis instead of
``code.run``. A release moves messages from the users' lists into ``code.run``, in turns,
as the real Celery messages they are; from there the worker consumes, claims and
acknowledges exactly as before.

The state (keys in worker.protocol, all changed by the scripts below and nothing else):

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

Who releases: the API at submit (the enqueue script releases in the same call, so a run
with room goes to ``code.run`` with no added latency), the pool process when a job ends
(after its result is stored, before its message is acknowledged, so the freed slot finds
the next message), and each worker's main process every FAIR_RELEASE_INTERVAL_S
(``release_loop``: workers that join, runs whose job ended elsewhere). Every release is one Lua
script, atomic in Redis: many releasers never release one run twice nor overfill
``code.run``. Cost per run: one script call at submit (instead of kombu's LPUSH), one at
its end.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.utils.json import dumps

from executor.settings import Settings
from worker.protocol import (
    FAIR_BACKLOG_KEY,
    FAIR_CAPPED_KEY,
    FAIR_CLOCK_KEY,
    FAIR_COUNTS_KEY,
    FAIR_HELD_COUNT_KEY,
    FAIR_HELD_KEY,
    FAIR_JOBS_KEY,
    FAIR_MESSAGES_KEY,
    FAIR_MIN_AHEAD,
    FAIR_RELEASE_INTERVAL_S,
    FAIR_USERS_KEY,
    FAIR_WAIT_PREFIX,
    HEADER_FAIR_USER,
    QUEUE_RUN,
    fair_wait_key,
    workers_key,
)

log = logging.getLogger("studio_code.worker")

#: most runs one script call releases (the rest: the next call)
RELEASE_MAX = 500
#: users meta and /metrics rank by runs waiting
TOP_USERS = 5

#: every script's KEYS, in this order (the user lists are FAIR_WAIT_PREFIX + user)
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
)

# ARGV[1] the wait-list prefix, ARGV[2] the per-user cap (0: none), ARGV[3] FAIR_MIN_AHEAD,
# ARGV[4] most runs to release; the script's own arguments follow.
_COMMON_LUA = """
local Q, WORKERS, USERS, CAPPED, JOBS, MSGS, HELD, HELD_N, COUNTS, CLOCK, BACKLOG = unpack(KEYS)
local WAIT = ARGV[1]
local CAP = tonumber(ARGV[2])
local MIN_AHEAD = tonumber(ARGV[3])
local MAX_RELEASE = tonumber(ARGV[4])

local function clock()
  return tonumber(redis.call('GET', CLOCK) or '0')
end

local function held_by(user)
  return tonumber(redis.call('HGET', HELD_N, user) or '0')
end

local function at_cap(user)
  return CAP > 0 and held_by(user) >= CAP
end

-- the run slots of the live, serving workers of code.run (their heartbeats)
local function live_slots()
  local t = redis.call('TIME')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  local total = 0
  local all = redis.call('HGETALL', WORKERS)
  for j = 2, #all, 2 do
    local ok, e = pcall(cjson.decode, all[j])
    if ok and type(e) == 'table' and e['state'] == 'serving'
        and (tonumber(e['expires_at']) or 0) > now then
      total = total + (tonumber(e['slots']) or 0)
    end
  end
  return total
end

-- a run leaves its user's list (released or forgotten): the counts follow
local function unlisted(job, user)
  redis.call('HDEL', JOBS, job)
  redis.call('HDEL', MSGS, job)
  redis.call('RPOP', BACKLOG)
  if tonumber(redis.call('ZINCRBY', COUNTS, -1, user)) <= 0 then
    redis.call('ZREM', COUNTS, user)
  end
end

local function release()
  if CAP <= 0 then  -- no cap (any more): parked users take their turns again
    local parked = redis.call('HGETALL', CAPPED)
    for j = 1, #parked, 2 do
      redis.call('ZADD', USERS, tonumber(parked[j + 1]), parked[j])
    end
    if #parked > 0 then redis.call('DEL', CAPPED) end
  end
  local room = math.max(MIN_AHEAD, live_slots()) - redis.call('LLEN', Q)
  if room > MAX_RELEASE then room = MAX_RELEASE end
  local n = 0
  while n < room do
    local top = redis.call('ZRANGE', USERS, 0, 0, 'WITHSCORES')
    if #top == 0 then break end
    local user, vt = top[1], tonumber(top[2])
    local list = WAIT .. user
    local job = redis.call('LPOP', list)
    if job then
      local msg = redis.call('HGET', MSGS, job)
      unlisted(job, user)
      if msg then
        redis.call('LPUSH', Q, msg)
        redis.call('HSET', HELD, job, user)
        redis.call('HINCRBY', HELD_N, user, 1)
        n = n + 1
      end
      redis.call('SET', CLOCK, vt)
    end
    if redis.call('LLEN', list) == 0 then
      redis.call('ZREM', USERS, user)
    elseif at_cap(user) then
      redis.call('ZREM', USERS, user)
      redis.call('HSET', CAPPED, user, vt + 1)
    else
      redis.call('ZADD', USERS, vt + 1, user)
    end
  end
  return n
end
"""

# ARGV[5] job id, ARGV[6] user, ARGV[7] the kombu message. Returns the runs released.
_ENQUEUE_LUA = (
    _COMMON_LUA
    + """
local job, user, msg = ARGV[5], ARGV[6], ARGV[7]
-- once per job (waiting or released): kombu's publish retry may put one message twice
if redis.call('HEXISTS', HELD, job) == 0 and redis.call('HSETNX', JOBS, job, user) == 1 then
  redis.call('HSET', MSGS, job, msg)
  redis.call('ZINCRBY', COUNTS, 1, user)
  redis.call('LPUSH', BACKLOG, '1')
  if redis.call('RPUSH', WAIT .. user, job) == 1 then
    if at_cap(user) then
      redis.call('HSET', CAPPED, user, clock())
    else
      redis.call('ZADD', USERS, clock(), user)
    end
  end
end
return release()
"""
)

# ARGV[5..] job ids whose job ended (their cap slot is free). Returns the runs released.
_ENDED_LUA = (
    _COMMON_LUA
    + """
for i = 5, #ARGV do
  local job = ARGV[i]
  local user = redis.call('HGET', HELD, job)
  if user then
    redis.call('HDEL', HELD, job)
    local left = redis.call('HINCRBY', HELD_N, user, -1)
    if left <= 0 then redis.call('HDEL', HELD_N, user); left = 0 end
    local parked = redis.call('HGET', CAPPED, user)
    if parked and (CAP <= 0 or left < CAP) then
      redis.call('HDEL', CAPPED, user)
      redis.call('ZADD', USERS, math.max(tonumber(parked), clock()), user)
    end
  end
end
return release()
"""
)

# ARGV[5..] job ids taken off their user's list (cancelled, ended while waiting). Returns
# how many were on a list.
_FORGET_LUA = (
    _COMMON_LUA
    + """
local n = 0
for i = 5, #ARGV do
  local job = ARGV[i]
  local user = redis.call('HGET', JOBS, job)
  if user then
    local list = WAIT .. user
    redis.call('LREM', list, 1, job)
    unlisted(job, user)
    if redis.call('LLEN', list) == 0 then
      redis.call('ZREM', USERS, user)
      redis.call('HDEL', CAPPED, user)
    end
    n = n + 1
  end
end
return n
"""
)

# ARGV[5] job id. Returns {} when it is on no list, else {user, runs of the user ahead,
# users whose turn comes first (-1: the user is at its cap), users waiting}.
_WHERE_LUA = (
    _COMMON_LUA
    + """
local job = ARGV[5]
local user = redis.call('HGET', JOBS, job)
if not user then return {} end
local pos = redis.call('LPOS', WAIT .. user, job) or 0
local rank = redis.call('ZRANK', USERS, user)
if not rank then rank = -1 end
return {user, pos, rank, redis.call('ZCARD', USERS) + redis.call('HLEN', CAPPED)}
"""
)

# ARGV[5] how many users to rank. Returns {runs waiting, users waiting, runs held,
# user, waiting, held, user, waiting, held, ...} for the users with the most runs waiting.
_STATS_LUA = (
    _COMMON_LUA
    + """
local top = redis.call('ZREVRANGE', COUNTS, 0, tonumber(ARGV[5]) - 1, 'WITHSCORES')
local out = {redis.call('HLEN', JOBS), redis.call('ZCARD', COUNTS), redis.call('HLEN', HELD)}
for j = 1, #top, 2 do
  table.insert(out, top[j])
  table.insert(out, tonumber(top[j + 1]))
  table.insert(out, held_by(top[j]))
end
return out
"""
)


@dataclass(frozen=True)
class Waiting:
    """Where a run held back by fairness (or its user's cap) waits."""

    user: str
    #: runs of the same user ahead of it on its list
    position: int
    #: users whose turn comes before its user's next one; None: the user is at its cap
    users_ahead: int | None
    #: users with runs waiting (its own included)
    users_waiting: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "queue": QUEUE_RUN,
            "held_by": "user_cap" if self.users_ahead is None else "fairness",
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
    """The per-user cap the scripts apply (0: none; fairness off: none)."""
    return settings.queue_run_user_slots if settings.queue_run_fairness == "users" else 0


class FairQueue:
    """The scripts above on one Redis client. Every method raises redis.RedisError when
    Redis cannot be reached."""

    def __init__(self, client: redis.Redis, cap: int) -> None:
        self.client = client
        self.cap = cap
        self._enqueue = client.register_script(_ENQUEUE_LUA)
        self._ended = client.register_script(_ENDED_LUA)
        self._forget = client.register_script(_FORGET_LUA)
        self._where = client.register_script(_WHERE_LUA)
        self._stats = client.register_script(_STATS_LUA)
        self._release = client.register_script(_COMMON_LUA + "\nreturn release()\n")

    def _args(self, *more: Any) -> list[Any]:
        return [FAIR_WAIT_PREFIX, self.cap, FAIR_MIN_AHEAD, RELEASE_MAX, *more]

    def enqueue(self, job_id: str, user: str, message: str, client: Any = None) -> int:
        """Put a run's message on its user's list, then release what has room (returns
        how many runs went to code.run)."""
        return int(
            self._enqueue(
                keys=KEYS, args=self._args(job_id, user, message), client=client or self.client
            )
        )

    def release(self) -> int:
        """Move waiting runs into code.run, in turns, while it has room."""
        return int(self._release(keys=KEYS, args=self._args()))

    def ended(self, job_ids: list[str]) -> int:
        """These jobs ended: their user's cap slots are free. Then release."""
        return int(self._ended(keys=KEYS, args=self._args(*job_ids)))

    def add_ended(self, pipe: Any, job_ids: list[str]) -> None:
        """``ended`` added to a pipeline the job's end shares (EVALSHA only: a pipeline
        given the script object would first ask SCRIPT EXISTS, a round trip of its own).
        The reply is a NoScriptError when this Redis has not loaded the script yet (new,
        restarted, failed over): ``ended`` then loads it."""
        pipe.evalsha(self._ended.sha, len(KEYS), *KEYS, *self._args(*job_ids))

    def forget(self, job_ids: list[str]) -> int:
        """Take runs off their users' lists (cancelled or ended while waiting there)."""
        if not job_ids:
            return 0
        return int(self._forget(keys=KEYS, args=self._args(*job_ids)))

    def where(self, job_id: str) -> Waiting | None:
        """Where ``job_id`` waits, when it is on a user's list (None: it is not)."""
        reply = self._where(keys=KEYS, args=self._args(job_id))
        if not reply:
            return None
        user, position, rank, users = reply
        return Waiting(_text(user), int(position), None if int(rank) < 0 else int(rank), int(users))

    def stats(self, top: int = TOP_USERS) -> FairStats:
        reply = self._stats(keys=KEYS, args=self._args(max(1, top)))
        waiting, users, held, *rest = reply
        loads = tuple(
            UserLoad(_text(rest[i]), int(rest[i + 1]), int(rest[i + 2]))
            for i in range(0, len(rest) - 2, 3)
        )
        return FairStats(int(waiting), int(users), int(held), loads)

    def held(self) -> dict[str, str]:
        """job id -> user of every run released and not ended (bounded by the runs in
        code.run and the workers' slots, plus any whose end was not seen)."""
        return {_text(k): _text(v) for k, v in self.client.hgetall(FAIR_HELD_KEY).items()}

    def reconcile(self, finished: set[str]) -> int:
        """End the held runs of ``held()`` whose job the run store says ended (their
        end was not seen: the reaper failed them, a worker died after the result)."""
        return self.ended(sorted(finished)) if finished else 0


# --- the broker channel's part (worker.broker composes it) -----------------------------------

#: the broker transport option that carries the per-user cap to the channel
CAP_OPTION = "studio_fair_user_cap"

if TYPE_CHECKING:
    _ChannelBase = kombu_redis.Channel
else:
    _ChannelBase = object


class FairChannel(_ChannelBase):
    """A part of kombu's Redis channels (plain and Sentinel: worker.broker composes them):
    a message for code.run carrying ``HEADER_FAIR_USER`` goes to its user's waiting list
    instead (the message kombu built, unchanged). Every other message is kombu's."""

    _fair: FairQueue | None = None

    def _put(self, queue: str, message: Any, **kwargs: Any) -> Any:
        headers = message.get("headers") or {}
        user = headers.get(HEADER_FAIR_USER)
        if queue != QUEUE_RUN or user is None or kwargs.get("_publish_batch") is not None:
            return super()._put(queue, message, **kwargs)
        with self.conn_or_acquire() as client:
            if self._fair is None:
                cap = int(self.connection.client.transport_options.get(CAP_OPTION) or 0)
                self._fair = FairQueue(client, cap)
            self._fair.enqueue(str(headers["id"]), str(user), dumps(message), client=client)
        return None


def transport_options(settings: Settings) -> dict[str, Any]:
    """The broker transport options the channel's part reads (worker.broker adds them)."""
    return {CAP_OPTION: user_cap(settings)}


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


def job_ended(queue: FairQueue, job_id: str) -> None:
    """A pool process's job ended: free its user's cap slot and release (never raises: the
    main process's releases and the sweep's reconcile catch up)."""
    try:
        queue.ended([job_id])
    except Exception as e:  # noqa: BLE001 - the job's outcome is stored; this is bookkeeping
        log.warning("job %s: fair release after its end failed (%s); the workers retry", job_id, e)


__all__ = [
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
