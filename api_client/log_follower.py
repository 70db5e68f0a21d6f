"""Live logs, the reader's side: follow a job's Redis stream (worker.job.log_publisher) until the
run store says the job has finished, then end with the stored outcome.

``follow`` (sync: ``CodeClient.follow_logs``, the CLI) and ``follow_async`` (the SSE route)
yield the same ``LogEvent``s:

* ``log``: text as it was printed (UTF-8 decoded incrementally: a character split between
  two pieces is never broken), at most STUDIO_CODE_LOG_MAX_BYTES in all;
* ``truncated``: the stored logs' truncation mark, when more was printed than is kept;
* ``rerun``: the attempt before did not finish (lost to the infrastructure, worker.job.rerun,
  or its worker stopped) and the job runs again: what follows is attempt ``data`` JSON
  ``{"attempt": N}``'s output, from its start (the earlier attempt's text above it is not
  the run's; the stored logs are the last attempt's);
* ``end``: the job finished; ``data`` is JSON ``{"status", "logs_truncated"}``. A follow
  that cannot go on ends too, with ``reason`` (and ``message``) in ``data``: ``stream_refused``
  when Redis refuses the read (``ResponseError``: e.g. an event id it cannot take),
  ``redis_unavailable`` after REDIS_RETRIES failed reads in a row (an outage), ``status``
  then being the run's status as last read (a running run's: reconnect to go on).

A job that finished before anyone followed, or whose stream expired, is answered from the
stored logs (one ``log``, maybe ``truncated``, then ``end``). The stored logs stay the truth.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

import redis

from api_client.waiting import REDIS_FAILED, Pause
from executor.store import JobRecord, RunSummary
from worker.protocol import logs_key

BLOCK_MS = 500
BLOCK_GRACE_S = 1.0  # an XREAD answered this much later than its block time is given up
MARK = "\n[logs truncated:"
#: failed reads in a row (Redis down or silent) after which a follow ends, the pause
#: between them doubling from REDIS_PAUSE_S to REDIS_PAUSE_MAX_S (about 35 s of refused
#: connections: a restart or a failover is outlived): a longer outage ends the stream (the
#: caller reconnects with its Last-Event-ID) instead of holding a connection and reading
#: the store for an hour
REDIS_RETRIES = 20
REDIS_PAUSE_S = 0.2
REDIS_PAUSE_MAX_S = 2.0


@dataclass(frozen=True)
class LogEvent:
    event: str  # log | truncated | rerun | end
    data: str
    id: str | None = None


def _mark(rec: JobRecord) -> str | None:
    if not rec.logs_truncated:
        return None
    at = rec.logs.rfind(MARK)
    return rec.logs[at:] if at >= 0 else None


def _cut(run: RunSummary, rec: JobRecord | None, reason: str, message: str) -> LogEvent:
    """The ``end`` of a follow that cannot go on (``run`` may still be running; ``rec``:
    its record when it has finished)."""
    data = {
        "status": (rec or run).status.value,
        "logs_truncated": rec.logs_truncated if rec is not None else False,
        "reason": reason,
        "message": message,
    }
    return LogEvent("end", json.dumps(data))


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
                attempt = fields.get(b"rerun")
                if attempt:  # a re-run starts: the lost attempt's half character is dropped
                    self.decoder.reset()
                    events.append(LogEvent("rerun", _attempt_data(attempt), entry_id))
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


def _attempt_data(raw: bytes) -> str:
    try:
        return json.dumps({"attempt": int(raw)})
    except ValueError:
        return json.dumps({"attempt": None})


class _ReadStatus:
    """Read the job's summary (``status``); send it (None: unknown)."""


class _ReadFinal:
    """Read the job's whole record (``final``); send it (None: unknown)."""


@dataclass(frozen=True)
class _Xread:
    """XREAD the stream after ``last_id`` (``block_ms`` None: do not block); send the reply,
    REDIS_FAILED when Redis failed (or did not answer in time), or a ``Refused`` when
    Redis answered with an error (``redis.ResponseError``: asking again cannot help)."""

    key: str
    last_id: str
    block_ms: int | None


@dataclass(frozen=True)
class Refused:
    """Redis's error answer to an XREAD (its sentence)."""

    message: str


_READ_STATUS = _ReadStatus()
_READ_FINAL = _ReadFinal()

_Step = LogEvent | _ReadStatus | _ReadFinal | _Xread | Pause


def _steps(job_id: str, timeout_s: float, last_id: str) -> Generator[_Step, Any, None]:
    """The decision of both followers, written once: yields the events to pass on and the
    I/O to do next (each driver does it and sends what it read). Until the deadline: read
    the job's summary (unknown: stop); read the stream, blocking BLOCK_MS while the job
    runs; once the job has finished and its stream has nothing more, end with the stored
    outcome (with the stored logs when the stream gave none). Redis refusing the read, or
    failing REDIS_RETRIES times in a row, ends the follow (``_cut``)."""
    f = _Follower(last_id)
    key = logs_key(job_id)
    deadline = time.monotonic() + timeout_s
    failures = 0
    while time.monotonic() < deadline:
        run = yield _READ_STATUS
        if run is None:
            return
        done = run.finished
        reply = yield _Xread(key, f.last_id, None if done else BLOCK_MS)
        if isinstance(reply, Refused):
            yield _cut(
                run,
                (yield _READ_FINAL) if done else None,
                "stream_refused",
                f"Redis refused to read the live logs after event {f.last_id} ({reply.message}):"
                " reconnect without Last-Event-ID, or read the stored logs (without follow).",
            )
            return
        if reply is REDIS_FAILED:  # a dead connection times out (STUDIO_REDIS_DEAD_AFTER_S)
            failures += 1
            if failures >= REDIS_RETRIES:
                yield _cut(
                    run,
                    (yield _READ_FINAL) if done else None,
                    "redis_unavailable",
                    f"Redis did not answer {failures} reads in a row, so the live logs "
                    "stopped: reconnect with the last event id to go on once Redis is back "
                    "(the stored logs are kept whatever happens).",
                )
                return
            yield Pause(min(REDIS_PAUSE_S * 2 ** (failures - 1), REDIS_PAUSE_MAX_S))
            continue
        failures = 0
        yield from f.take(reply)
        if done and not reply:
            rec = yield _READ_FINAL
            if rec is not None:
                yield from _ending(rec, with_logs=not f.seen_any)
            return


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
    steps = _steps(job_id, timeout_s, last_id)
    seen: Any = None
    while True:
        try:
            step = steps.send(seen)
        except StopIteration:
            return
        seen = None
        if isinstance(step, LogEvent):
            yield step
        elif step is _READ_STATUS:
            seen = status()
        elif step is _READ_FINAL:
            seen = final()
        elif isinstance(step, Pause):
            time.sleep(step.seconds)
        elif isinstance(step, _Xread):
            try:
                seen = client.xread({step.key: step.last_id}, count=1000, block=step.block_ms)
            except redis.ResponseError as e:
                seen = Refused(str(e))
            except redis.RedisError:
                seen = REDIS_FAILED


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
    steps = _steps(job_id, timeout_s, last_id)
    seen: Any = None
    while True:
        try:
            step = steps.send(seen)
        except StopIteration:
            return
        seen = None
        if isinstance(step, LogEvent):
            yield step
        elif step is _READ_STATUS:
            seen = await asyncio.to_thread(status)
        elif step is _READ_FINAL:
            seen = await asyncio.to_thread(final)
        elif isinstance(step, Pause):
            await asyncio.sleep(step.seconds)
        elif isinstance(step, _Xread):
            try:
                # a silent connection must not hold the follower (its socket timeout is
                # STUDIO_REDIS_DEAD_AFTER_S): give up the read, ask again on a fresh one
                async with asyncio.timeout(BLOCK_MS / 1000 + BLOCK_GRACE_S):
                    seen = await client.xread(
                        {step.key: step.last_id}, count=1000, block=step.block_ms
                    )
            except redis.ResponseError as e:
                seen = Refused(str(e))
            except (redis.RedisError, TimeoutError):
                seen = REDIS_FAILED
