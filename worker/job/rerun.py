"""A run the infrastructure killed, run again elsewhere (docs/operations.md, "Faults").

When the executor's result says the sandbox was lost to the infrastructure
(``CodeResult.lost``, from ``InfrastructureLost``: the engine went away or restarted, the
sandbox vanished, its stream or its wait broke; its trace shows a ``sandbox.lost`` row, for
people only), the outcome is never the code's:

* a runtime whose re-run is harmless (``Runtime.rerun_safe``: docker, no network, no host
  files, nothing kept) hands the job back while it has attempts left (MAX_ATTEMPTS, the
  bound of every redelivery): the cause is pushed to ``studio:lost:<job_id>`` first, the
  main process probes the runtime at once (the gate: the worker steps aside while it is
  unhealthy), and the next attempt,
  on whichever worker takes it, reads the causes and puts a ``job.rerun`` row first in
  its trace. The result is written once, by the attempt that ends it.
* otherwise (the subprocess runtime: the code reaches the network and host files, a re-run
  is not harmless; or the attempts are spent) the job ends ``failed`` RUNTIME_UNAVAILABLE
  with the executor's sentence naming the cause.

A sandbox the engine refused to make or start (``SandboxRefused``: ``CodeResult.refused``,
shown as a ``sandbox.refused`` trace row) was never lost: the job's input was never
written, and a re-run would meet the same refusal. It ends at once, never handed back:
CODE_INVALID when the node asked for limits of its own, else RUNTIME_UNAVAILABLE, and then
the gate is told once (``refused_by_engine``).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import redis

from executor.models import CodeResult, TraceRow
from executor.service import REFUSED_ENGINE, RERUN_STEP
from worker.protocol import lost_key

log = logging.getLogger("studio_code.worker")

#: how long the causes of a handed-back job are kept for its next attempt
LOST_TTL_S = 24 * 3600


def lost_cause(result: CodeResult) -> str | None:
    """The machine-readable cause when the infrastructure killed this run's sandbox."""
    return result.lost


def refused_by_engine(result: CodeResult) -> bool:
    """True when the engine refused this run's sandbox before its input was written and
    the node asked for nothing of its own (SandboxRefused: RUNTIME_UNAVAILABLE, refused
    ``engine``). The job never ran, so it is never run again: it ends now, and the worker's
    runtime gate is told once."""
    return result.refused == REFUSED_ENGINE


def add_lookup(pipe: Any, job_id: str) -> None:
    """Adds the read of the job's earlier lost attempts to a start-of-job pipeline."""
    pipe.lrange(lost_key(job_id), 0, -1)


def record(client: redis.Redis, job_id: str, attempt: int, cause: str, worker: str) -> None:
    """Keep why attempt ``attempt`` was lost, for the next attempt's trace (never raises:
    without it the next attempt's row says only that it is a re-run)."""
    body = json.dumps({"attempt": attempt, "cause": cause, "worker": worker})
    try:
        pipe = client.pipeline(transaction=False)
        pipe.rpush(lost_key(job_id), body)
        pipe.expire(lost_key(job_id), LOST_TTL_S)
        pipe.execute()
    except redis.RedisError as e:
        log.warning("job %s: could not keep why its attempt %d was lost: %s", job_id, attempt, e)


def decode(raw: Any) -> list[dict[str, Any]]:
    out = []
    for item in raw or []:
        try:
            entry = json.loads(item)
        except (TypeError, ValueError):
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out


def describe(lost: list[dict[str, Any]]) -> str:
    """``attempt 1 on w@h: engine_stopping; ...``"""
    return "; ".join(
        f"attempt {e.get('attempt', '?')} on {e.get('worker', '?')}: {e.get('cause', '?')}"
        for e in lost
    )


def with_rerun_row(result: CodeResult, attempt: int, lost: list[dict[str, Any]]) -> CodeResult:
    """``result`` with a first trace row saying why attempt ``attempt`` ran again."""
    row = TraceRow(
        step=RERUN_STEP,
        runtime=result.runtime,
        duration_ms=0.0,
        detail=f"attempt {attempt}, after the infrastructure lost the sandbox of {describe(lost)}",
    )
    return result.model_copy(update={"trace": [row, *result.trace]})


def exhausted(result: CodeResult, attempt: int, lost: list[dict[str, Any]]) -> CodeResult:
    """The last attempt's infrastructure failure, its message saying every cause."""
    if result.error is None:
        return result
    causes = describe(lost)
    message = (
        f"{result.error.message} It was attempt {attempt}, the last: the job is not run "
        "again by itself" + (f" (earlier: {causes})." if causes else ".")
    )
    return result.model_copy(update={"error": result.error.model_copy(update={"message": message})})
