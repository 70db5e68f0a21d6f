"""After an attempt of a node with a retry policy (executor.retry): queue the next one, or end
the run with every attempt in its history.

The next attempt goes back to the run store, not to a countdown in this process or Redis:
one conditional UPDATE (running -> queued, by the worker holding the claim) writes the
attempt's row into the run's history and the time before which it may not be claimed
(``not_before_ts``). A worker's sweep (worker.upkeep.retry_due) sends its message once it is
due; a crash anywhere after the UPDATE loses nothing (the row is the promise, and the lost-
message sweep covers a sweep that died between marking and sending). A cancel meanwhile
ends the run ``cancelled`` (request_cancel of a queued row).
"""

from __future__ import annotations

import logging
import time

from executor.errors import ErrorCode
from executor.models import Attempt, CodeResult, TraceRow
from executor.retry import attempt_row, delay_s, mib, more_memory, retry_code
from executor.settings import Settings
from executor.store import JobRecord, RunStore

log = logging.getLogger("studio_code.worker")


def after_attempt(
    store: RunStore, settings: Settings, rec: JobRecord, result: CodeResult, worker: str
) -> CodeResult | None:
    """None when the next attempt was queued (the run waits out its delay); else the result
    to finish with, its ``history`` every attempt (this one last), a trace row per earlier
    attempt and a warning for each memory raise."""
    policy = rec.retry
    if policy is None:
        return result
    number = len(rec.history) + 1
    limit = rec.memory_bytes or settings.memory_bytes
    row = attempt_row(result, number, memory_bytes=limit, worker=worker, ended_at=time.time())
    code = retry_code(result, policy)
    if code is not None and number < policy.max_attempts:
        wait = delay_s(policy, number)
        memory = rec.memory_bytes
        if code is ErrorCode.CODE_MEMORY:
            peak = None if result.usage is None else result.usage.memory_peak_bytes
            memory = more_memory(limit, peak, settings.max_memory_bytes)
        due = time.time() + wait
        row = row.model_copy(update={"retry_at": due, "next_memory_bytes": memory})
        if store.retry(
            rec.job_id, worker, history=[*rec.history, row], not_before_ts=due, memory_bytes=memory
        ):
            log.warning(
                "job %s: attempt %d of %d ended %s; attempt %d in %.2f s with %s",
                rec.job_id,
                number,
                policy.max_attempts,
                code.value,
                number + 1,
                wait,
                mib(memory or limit),
            )
            return None
        # not running under this claim any more (cancelled meanwhile): it ends now
    history = [*rec.history, row]
    return result.model_copy(
        update={
            "history": history,
            "trace": _trace(history[:-1], result) + list(result.trace),
            "warnings": list(result.warnings) + _warnings(history),
        }
    )


def _trace(earlier: list[Attempt], result: CodeResult) -> list[TraceRow]:
    return [
        TraceRow(
            step="attempt",
            runtime=result.runtime,
            duration_ms=a.duration_ms,
            detail=f"attempt {a.attempt}: {a.status} {a.code or ''} with {mib(a.memory_bytes)}"
            + ("" if a.retry_at is None else f"; retried with {mib(a.next_memory_bytes)}"),
        )
        for a in earlier
    ]


def _warnings(history: list[Attempt]) -> list[str]:
    out = []
    for a in history:
        if a.code == ErrorCode.CODE_MEMORY.value and a.retry_at is not None:
            peak = (a.usage or {}).get("memory_peak_bytes")
            if a.next_memory_bytes and a.memory_bytes and a.next_memory_bytes > a.memory_bytes:
                out.append(
                    f"Attempt {a.attempt} ran out of memory ({mib(a.memory_bytes)}, peak "
                    f"{mib(peak)}); attempt {a.attempt + 1} asked for "
                    f"{mib(a.next_memory_bytes)} (at most STUDIO_CODE_MAX_MEMORY)."
                )
            else:
                out.append(
                    f"Attempt {a.attempt} ran out of memory ({mib(a.memory_bytes)}) and no more "
                    "could be asked for (STUDIO_CODE_MAX_MEMORY): attempt "
                    f"{a.attempt + 1} ran with the same."
                )
    return out
