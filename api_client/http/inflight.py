"""How many editor test calls one user has waiting at once (STUDIO_CODE_TEST_IN_FLIGHT),
counted in Redis so the cap holds across API processes.

Each waiting call is one member of a sorted set per user, scored with the time it gives
up waiting. Taking a slot first drops members whose time has passed, so a slot held by
an API process that died is freed when that call would have stopped waiting anyway; a
call that ends (answered, failed, or its caller went away) removes its own member at once
(``release`` runs even while its task is being cancelled; ``release_now`` sends the removal
as the answer goes out, and the request ends once Redis has it).
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis

from executor.errors import RateLimited, RuntimeUnavailable
from worker.protocol import in_flight_key

#: Retry-After of a refused call: a test call usually ends within seconds
RETRY_AFTER_S = 2

#: releases under way (a task the loop holds only weakly must be held here)
_RELEASING: set[asyncio.Task[None]] = set()

_ACQUIRE_LUA = """
local key = KEYS[1]
local limit = tonumber(ARGV[1])
local hold_ms = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
if redis.call('ZCARD', key) >= limit then
  return 0
end
redis.call('ZADD', key, now + hold_ms, ARGV[3])
local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
redis.call('PEXPIRE', key, tonumber(last[2]) - now + 1000)
return 1
"""


@dataclass(frozen=True)
class Slot:
    """One admitted call; give it back with ``InFlight.release``."""

    key: str
    token: str


class InFlight:
    """The per-user cap on waiting test calls (redis.asyncio: no thread is held)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    async def acquire(self, aredis: Any, user: str, hold_s: float) -> Slot:
        """Take a slot for a call that waits at most ``hold_s``; raises RateLimited when
        the user already has ``limit`` calls waiting."""
        slot = Slot(in_flight_key(user), uuid.uuid4().hex)
        try:
            admitted = await aredis.eval(
                _ACQUIRE_LUA, 1, slot.key, self.limit, math.ceil(hold_s * 1000), slot.token
            )
        except redis.RedisError as e:
            raise RuntimeUnavailable(
                f"Redis at STUDIO_REDIS_URL cannot count waiting editor test calls ({e}): "
                "check that it is up."
            ) from e
        if not admitted:
            who = f"User {user!r}" if user else "This user"
            raise RateLimited(
                f"{who} already has {self.limit} editor test calls waiting for their result "
                f"(the limit, STUDIO_CODE_TEST_IN_FLIGHT={self.limit}): wait for one to "
                "finish, then try again.",
                retry_after_s=RETRY_AFTER_S,
            )
        return slot

    async def release(self, aredis: Any, slot: Slot) -> None:
        """Give the slot back; runs to the end even in a cancelled task. Redis down: the
        slot frees itself when its call would have stopped waiting."""
        import anyio

        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            try:
                await aredis.zrem(slot.key, slot.token)
            except redis.RedisError:
                pass

    def release_now(self, aredis: Any, slot: Slot) -> Callable[[], Awaitable[None]]:
        """Start giving the slot back at once, without waiting for Redis's answer (so a
        call's answer need not wait for that round trip); returns what waits until it is
        back, for the request's background task (the request ends only then)."""
        task = asyncio.ensure_future(self.release(aredis, slot))
        _RELEASING.add(task)
        task.add_done_callback(_RELEASING.discard)

        async def released() -> None:
            await asyncio.shield(task)

        return released
