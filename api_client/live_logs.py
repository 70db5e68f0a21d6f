"""Live logs, the reader's side: follow a job's Redis stream (worker.job.live_logs) until the
run store says the job has finished, then end with the stored outcome.

``follow`` (sync: ``CodeClient.follow_logs``, the CLI) and ``follow_async`` (the SSE route)
yield the same ``LogEvent``s:

* ``log``: text as it was printed (UTF-8 decoded incrementally: a character split between
  two pieces is never broken), at most STUDIO_CODE_LOG_MAX_BYTES in all;
* ``truncated``: the stored logs' truncation mark, when more was printed than is kept;
* ``end``: the job finished; ``data`` is JSON ``{"status", "logs_truncated"}``.

A job that finished before anyone followed, or whose stream expired, is answered from the
stored logs (one ``log``, maybe ``truncated``, then ``end``). The stored logs stay the truth.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import redis

from executor.store import JobRecord, RunSummary
from worker.protocol import logs_key

BLOCK_MS = 500
BLOCK_GRACE_S = 1.0  # an XREAD answered this much later than its block time is given up
MARK = "\n[logs truncated:"


@dataclass(frozen=True)
class LogEvent:
    event: str  # log | truncated | end
    data: str
    id: str | None = None


def _mark(rec: JobRecord) -> str | None:
    if not rec.logs_truncated:
        return None
    at = rec.logs.rfind(MARK)
    return rec.logs[at:] if at >= 0 else None


def _ending(rec: JobRecord, *, with_logs: bool) -> list[LogEvent]:
    out = []
    if with_logs:
        logs = rec.logs
        mark = _mark(rec)
        if mark is not None:
            logs = logs[: len(logs) - len(mark)]
        if logs:
            out.append(LogEvent("log", logs))
    mark = _mark(rec)
    if mark is not None:
        out.append(LogEvent("truncated", mark))
    out.append(
        LogEvent(
            "end", json.dumps({"status": rec.status.value, "logs_truncated": rec.logs_truncated})
        )
    )
    return out


class _Follower:
    """The state both loops share: the last entry read, the decoder, what was seen."""

    def __init__(self, last_id: str = "0-0") -> None:
        self.last_id = last_id
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.seen_any = last_id != "0-0"
        self.ended = False

    def take(self, reply: Any) -> list[LogEvent]:
        events = []
        for _key, entries in reply or []:
            for entry_id, fields in entries:
                entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                self.last_id = entry_id
                self.seen_any = True
                data = fields.get(b"d")
                if data:
                    text = self.decoder.decode(data)
                    if text:
                        events.append(LogEvent("log", text, entry_id))
                if fields.get(b"end"):
                    self.ended = True
                    rest = self.decoder.decode(b"", final=True)
                    if rest:
                        events.append(LogEvent("log", rest, entry_id))
        return events


def follow(
    client: Any,
    job_id: str,
    status: Callable[[], RunSummary | None],
    final: Callable[[], JobRecord | None],
    *,
    timeout_s: float = 3600.0,
    last_id: str = "0-0",
) -> Iterator[LogEvent]:
    """Follow with a sync Redis client. ``status`` gives the job's summary (cheap, read
    each turn), ``final`` its whole record (read once, at the end); None: unknown."""
    f = _Follower(last_id)
    key = logs_key(job_id)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = status()
        if run is None:
            return
        done = run.finished
        try:  # a dead connection times out (STUDIO_REDIS_DEAD_AFTER_S): ask again
            reply = client.xread({key: f.last_id}, count=1000, block=None if done else BLOCK_MS)
        except redis.RedisError:
            time.sleep(0.2)
            continue
        yield from f.take(reply)
        if done and not reply:
            rec = final()
            if rec is not None:
                yield from _ending(rec, with_logs=not f.seen_any)
            return


async def follow_async(
    client: Any,
    job_id: str,
    status: Callable[[], RunSummary | None],
    final: Callable[[], JobRecord | None],
    *,
    timeout_s: float = 3600.0,
    last_id: str = "0-0",
) -> AsyncIterator[LogEvent]:
    """``follow`` with a redis.asyncio client; the store is read in a worker thread."""
    f = _Follower(last_id)
    key = logs_key(job_id)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = await asyncio.to_thread(status)
        if run is None:
            return
        done = run.finished
        try:
            # a silent connection must not hold the follower (its socket timeout is
            # STUDIO_REDIS_DEAD_AFTER_S): give up the read, ask again on a fresh one
            async with asyncio.timeout(BLOCK_MS / 1000 + BLOCK_GRACE_S):
                reply = await client.xread(
                    {key: f.last_id}, count=1000, block=None if done else BLOCK_MS
                )
        except (redis.RedisError, TimeoutError):
            await asyncio.sleep(0.2)
            continue
        for event in f.take(reply):
            yield event
        if done and not reply:
            rec = await asyncio.to_thread(final)
            if rec is not None:
                for event in _ending(rec, with_logs=not f.seen_any):
                    yield event
            return
