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
the gate is told once. ``decide`` is the one decision: finish or hand back.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import redis

from executor.errors import ErrorCode
from executor.models import CodeResult, Status, TraceRow
from executor.service import REFUSED_ENGINE, RERUN_STEP
from worker.protocol import MAX_ATTEMPTS, lost_key

log = logging.getLogger("studio_code.worker")

#: how long the causes of a handed-back job are kept for its next attempt
LOST_TTL_S = 24 * 3600


class Decision(NamedTuple):
    """What the job path does with a run's result: ``finish`` (store ``result``) or ``hand
    back`` (the message goes back to its queue for another attempt). ``report``: what the
    worker's runtime gate is told (a hand-back always tells it; a finish when the engine
    refused the sandbox); ``note``: the worker's log line of a hand-back; ``cause``: a lost
    sandbox's cause, kept for the next attempt (``record``) before it is handed back."""

    action: Literal["finish", "hand back"]
    result: CodeResult
    report: str | None = None
    note: str = ""
    cause: str | None = None


def decide(
    result: CodeResult,
    *,
    claims: int,
    rerun_safe: bool,
    why_down: Callable[[], str | None],
    lost: list[dict[str, Any]],
) -> Decision:
    """The one re-run decision, from the result's typed facts (never its trace):

    * its sandbox lost to the infrastructure: hand back while the runtime's re-run is
      harmless (``rerun_safe``) and attempts are left (``claims`` < MAX_ATTEMPTS); else
      finish, the message naming every cause (``lost``: the earlier attempts') when the
      re-run would have been harmless;
    * its sandbox refused by the engine with the server's defaults: finish (a re-run would
      be refused the same way), the gate told once;
    * failed RUNTIME_UNAVAILABLE before its code started, with attempts left, while the
      runtime cannot run the language here (``why_down()``: why, or None): hand back;
    * anything else: finish."""
    cause = result.lost
    if cause is not None:
        if rerun_safe and claims < MAX_ATTEMPTS:
            return Decision(
                "hand back",
                result,
                f"a sandbox was lost to the infrastructure ({cause})",
                f"handed back to run again (attempt {claims} of {MAX_ATTEMPTS}): its sandbox "
                f"was lost to the infrastructure ({cause})",
                cause,
            )
        return Decision("finish", exhausted(result, claims, lost) if rerun_safe else result)
    if result.refused == REFUSED_ENGINE:
        return Decision("finish", result, f"the engine refused the sandbox of job {result.job_id}")
    error = result.error
    if (
        result.status is Status.FAILED
        and error is not None
        and error.code is ErrorCode.RUNTIME_UNAVAILABLE
        and not result.started
        and claims < MAX_ATTEMPTS
        and (reason := why_down()) is not None
    ):
        return Decision(
            "hand back",
            result,
            reason,
            f"handed back (attempt {claims} of {MAX_ATTEMPTS}): {reason}",
        )
    return Decision("finish", result)


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
