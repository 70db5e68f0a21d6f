"""How many editor test calls one user has waiting at once (STUDIO_CODE_TEST_IN_FLIGHT),
counted in Redis so the cap holds across API processes.

A call is admitted by one script (``InFlight.admit``) that also counts it against the
per-minute limit. Each waiting call is one member of a sorted set per user, scored with
the time it gives up waiting. Taking a slot first drops members whose time has passed,
so a slot held by an API process that died is freed when that call would have stopped
waiting anyway; a call that ends (answered, failed, or its caller went away) removes its
own member at once (``release`` runs even while its task is being cancelled;
``release_now`` sends the removal as the answer goes out, and the request ends once Redis
has it).
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis

from api_client.client import ADMIT_LUA, RATE_WINDOW_S, rate_limited
from executor.errors import RateLimited, RuntimeUnavailable
from worker.protocol import in_flight_key, rate_key

#: Retry-After of a refused call: a test call usually ends within seconds
RETRY_AFTER_S = 2

#: releases under way (a task the loop holds only weakly must be held here)
_RELEASING: set[asyncio.Task[None]] = set()


@dataclass(frozen=True)
class Slot:
    """One admitted call; give it back with ``InFlight.release``. ``rate_key``: the call
    was also counted against the per-minute limit there (``admit``)."""

    key: str
    token: str
    rate_key: str = ""


class InFlight:
    """The per-user cap on waiting test calls (redis.asyncio: no thread is held)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._admit: Any = None  # the admission script, on the client it was made for

    async def admit(
        self, aredis: Any, user: str, hold_s: float, per_minute: int, *, beside: Any = None
    ) -> Slot:
        """A slot for an editor test call that waits at most ``hold_s``, and its place in
        the user's per-minute count (STUDIO_CODE_TEST_PER_MINUTE), in one round trip
        (EVALSHA); raises RateLimited for either (too many waiting is said first). A call
        whose job is then not queued gives its place back with its slot:
        ``release(..., refund=True)``. ``beside``: a check whose one command goes in the
        same round trip, before the admission (a ServedCheck: its ``add`` puts the command
        in the pipeline; its ``reply`` is set to what it answered, or to the redis.RedisError
        the round trip raised); the caller judges it."""
        script = self._admit
        if script is None or script.registered_client is not aredis:
            script = self._admit = aredis.register_script(ADMIT_LUA)
        slot = Slot(in_flight_key(user), uuid.uuid4().hex, rate_key(user))
        keys = [slot.rate_key, slot.key]  # api_client/admit.lua, with a slot
        args = [
            per_minute,
            RATE_WINDOW_S * 1_000_000,
            slot.token,
            self.limit,
            math.ceil(hold_s * 1000),
        ]
        try:
            if beside is None:
                admitted, wait_us = await script(keys=keys, args=args)
            else:
                pipe = aredis.pipeline(transaction=False)
                beside.add(pipe)
                pipe.evalsha(script.sha, len(keys), *keys, *args)
                try:
                    beside.reply, reply = await pipe.execute(raise_on_error=False)
                except redis.RedisError as e:
                    beside.reply = e
                    raise
                if isinstance(reply, redis.exceptions.NoScriptError):
                    reply = await script(keys=keys, args=args)  # loads it, then runs it
                elif isinstance(reply, Exception):
                    raise reply
                admitted, wait_us = reply
        except redis.RedisError as e:
            raise RuntimeUnavailable(
                f"Redis at STUDIO_REDIS_URL cannot count editor test calls ({e}): check that "
                "it is up."
            ) from e
        if int(admitted) == 2:
            raise self._too_many(user)
        if not int(admitted):
            raise rate_limited(user, per_minute, int(wait_us))
        return slot

    def _too_many(self, user: str) -> RateLimited:
        who = f"User {user!r}" if user else "This user"
        return RateLimited(
            f"{who} already has {self.limit} editor test calls waiting for their result "
            f"(the limit, STUDIO_CODE_TEST_IN_FLIGHT={self.limit}): wait for one to "
            "finish, then try again.",
            retry_after_s=RETRY_AFTER_S,
        )

    async def release(self, aredis: Any, slot: Slot, *, refund: bool = False) -> None:
        """Give the slot back (``refund``: and the call's place in the per-minute count,
        for a call whose job was not queued); runs to the end even in a cancelled task.
        Redis down: the slot frees itself when its call would have stopped waiting."""
        import anyio

        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            try:
                if refund and slot.rate_key:
                    pipe = aredis.pipeline(transaction=False)
                    pipe.zrem(slot.key, slot.token)
                    pipe.zrem(slot.rate_key, slot.token)
                    await pipe.execute()
                else:
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
