"""Waiting for a job's end, decided once for ``CodeClient.wait`` (threads) and
``CodeClient.wait_async`` (the event loop): what to read next, when to block on the done
notice, when to stop and what to return.

``plan`` is a step machine (a generator): it yields the next action, is sent what that
action observed, and returns the record the wait ends with. The two drivers only do the I/O
of each action (a store read in the calling thread or on a reader thread, ``time.sleep`` or
``asyncio.sleep``, BLMOVE on redis or redis.asyncio), so a fix of the decision is made here
once (as httpx and h11 keep a protocol's decisions apart from their sync/async I/O).

The decision: a new wait reads the whole record at once (``CodeClient.status``, which ends
failed a job queued past its queue's bound or one a worker on another run store received);
a just-submitted one goes straight to the notice. Then it blocks on the worker's done notice
(BLMOVE from the list to itself: it wakes every waiter of the job and leaves the notice)
WAIT_SLICE_S at a time; the notice carries the finished record when it is short (the store
is not read again), a longer one makes it read the record. After a quiet slice it reads the
job's status only (cheap: no code, state or output), gives a job still queued the whole read
that settles it every SETTLE_EVERY_S, and reads the whole record once when the job has
finished or the deadline has passed.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from executor.models import Status
from executor.store import JobRecord
from worker.protocol import record_of_notice

WAIT_SLICE_S = 1.0  # the store is re-read at least this often
#: how often a still-queued job gets the whole read that settles it
SETTLE_EVERY_S = 5.0
#: after a notice of a run that did not finish the job (a duplicate delivery: the notice
#: stays), the wait pauses this long before it blocks again, so it does not spin on it
NOTICE_PAUSE_S = 0.05
#: after Redis failed a BLMOVE, the wait pauses this long before it reads the store again
REDIS_PAUSE_S = 0.2


class ReadRecord:
    """Read the job's whole record (``CodeClient.status``: settles a queued job, raises
    JobNotFound); send the JobRecord."""


class ReadStatus:
    """Read the job's status only; send it (None: the store does not know the job)."""


@dataclass(frozen=True)
class Block:
    """Sleep ``pause_s`` (when > 0), then BLMOVE the done notice list onto itself for
    ``block_s``; send the notice (None: none came), or REDIS_FAILED when Redis failed
    (or did not answer in time)."""

    pause_s: float
    block_s: float


@dataclass(frozen=True)
class Pause:
    """Sleep ``seconds``; send None."""

    seconds: float


READ_RECORD = ReadRecord()
READ_STATUS = ReadStatus()
#: what a driver sends after a Block when Redis failed
REDIS_FAILED = object()

Step = ReadRecord | ReadStatus | Block | Pause
Plan = Generator[Step, Any, JobRecord]


def plan(timeout_s: float, *, submitted: bool = False) -> Plan:
    """The steps of one wait of at most ``timeout_s`` (see the module's docstring).
    ``submitted``: the caller has just queued the job, so its end leaves a done notice
    that BLMOVE finds even if it came first: no first read."""
    deadline = time.monotonic() + timeout_s

    def left() -> float:
        return deadline - time.monotonic()

    next_settle = time.monotonic() + SETTLE_EVERY_S
    if not submitted or left() <= 0:
        rec: JobRecord = yield READ_RECORD
        if rec.finished or left() <= 0:
            return rec
    woke = False
    while True:
        remaining = left()
        notice = yield Block(
            min(remaining, NOTICE_PAUSE_S) if woke else 0.0,
            max(0.01, min(remaining, WAIT_SLICE_S)),
        )
        if notice is REDIS_FAILED:
            woke = False
            yield Pause(min(max(left(), 0.0), REDIS_PAUSE_S))
        else:
            ended = record_of_notice(notice)
            if ended is not None:  # the notice carries the finished record
                return ended
            woke = notice is not None
        if woke:
            rec = yield READ_RECORD
            if rec.finished or left() <= 0:
                return rec
            continue
        status: Status | None = yield READ_STATUS
        if status is None or status.finished or left() <= 0:
            # the whole record (JobNotFound for an unknown job), read once, at the end
            return (yield READ_RECORD)
        if status is Status.QUEUED and time.monotonic() >= next_settle:
            # still queued: past its queue's bound, or a worker on another store left a
            # notice (status() ends it failed then)
            next_settle = time.monotonic() + SETTLE_EVERY_S
            rec = yield READ_RECORD
            if rec.finished:
                return rec
