"""A node's retry policy (opt-in): what a submit may ask, checked the same way at every door
(HTTP body, CodeClient, CLI, the server's default STUDIO_CODE_RETRY), and what a worker
decides after an attempt: retry or not, after how long, with how much memory.

Only CODE_TIMEOUT, CODE_MEMORY and (when the caller names it) CODE_ERROR may be retried: a
Code node has no network, so every other outcome is deterministic (CODE_INVALID,
CODE_OUTPUT_INVALID), the caller's own (CODE_CANCELLED) or not the code's (RATE_LIMITED,
CODE_NODES_DISABLED, RUNTIME_UNAVAILABLE: the infrastructure's re-runs, worker.job.rerun).
A CODE_MEMORY retry asks for more memory: max(2 x the attempt's limit, 1.5 x its measured
peak), at most STUDIO_CODE_MAX_MEMORY.
"""

from __future__ import annotations

import json
import random
from typing import Any

from pydantic import ValidationError

from executor.errors import CodeInvalid, ErrorCode
from executor.models import (
    MAX_RETRY_ATTEMPTS,
    MAX_RETRY_DELAY_S,
    RETRYABLE_CODES,
    Attempt,
    CodeResult,
    RetryPolicy,
)

ALLOWED = ", ".join(c.value for c in RETRYABLE_CODES)
_SHAPE = (
    f'{{"max_attempts": 1..{MAX_RETRY_ATTEMPTS}, "backoff": {{"initial_s", "factor" (1..10), '
    f'"max_s" (each 0..{MAX_RETRY_DELAY_S:g} s), "jitter" (0..1)}}, "on": [{ALLOWED}]}}'
)


def parse_policy(value: Any) -> RetryPolicy | None:
    """The policy ``value`` asks for (a dict, its JSON text, a RetryPolicy, or None/"" for
    none); CodeInvalid naming the allowed outcomes and bounds when it is not one."""
    if value is None or isinstance(value, RetryPolicy):
        return value
    if isinstance(value, str | bytes):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except ValueError as e:
            raise CodeInvalid(f"retry is not JSON ({e}): give {_SHAPE}.") from None
    if not isinstance(value, dict):
        raise CodeInvalid(f"retry must be an object: {_SHAPE}.")
    on = value.get("on")
    if on is not None:
        if not isinstance(on, list | tuple) or not all(isinstance(c, str) for c in on):
            raise CodeInvalid(f"retry.on must be a list of outcome codes among {ALLOWED}.")
        refused = [c for c in on if c not in {r.value for r in RETRYABLE_CODES}]
        if refused:
            raise CodeInvalid(
                f"retry.on names {', '.join(refused)}, which is never retried (a deterministic "
                f"outcome, the caller's own, or not the code's): only {ALLOWED} may be."
            )
    try:
        return RetryPolicy.model_validate(value)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise CodeInvalid(f"retry.{where}: {first['msg']}; give {_SHAPE}.") from None


def policy_json(policy: RetryPolicy | None) -> str | None:
    return None if policy is None else policy.model_dump_json()


def retry_code(result: CodeResult, policy: RetryPolicy | None) -> ErrorCode | None:
    """The outcome of ``result`` the policy retries, or None (no policy, success, or an
    outcome it does not name)."""
    if policy is None or result.error is None:
        return None
    code = result.error.code
    return code if code in RETRYABLE_CODES and code in policy.on else None


def delay_s(policy: RetryPolicy, attempt: int, rand: random.Random | None = None) -> float:
    """The wait after attempt ``attempt`` (1-based) before the next one."""
    b = policy.backoff
    base = min(b.max_s, b.initial_s * b.factor ** max(0, attempt - 1))
    if b.jitter > 0 and base > 0:
        base *= 1 + (rand or random).uniform(-b.jitter, b.jitter)
    return max(0.0, min(MAX_RETRY_DELAY_S, base))


def more_memory(limit: int, peak: int | None, cap: int) -> int:
    """The memory of the attempt after a CODE_MEMORY one that ran under ``limit`` and peaked
    at ``peak`` (measured; None: unknown): max(2 x limit, 1.5 x peak), at most ``cap``."""
    want = max(2 * limit, int(1.5 * peak) if peak else 0)
    return max(limit, min(want, cap))


def attempt_row(
    result: CodeResult, number: int, *, memory_bytes: int | None, worker: str, ended_at: float
) -> Attempt:
    err = result.error
    return Attempt(
        attempt=number,
        status=result.status.value,
        code=None if err is None else err.code.value,
        message="" if err is None else err.message,
        duration_ms=result.duration_ms,
        usage=None if result.usage is None else result.usage.model_dump(mode="json"),
        memory_bytes=memory_bytes,
        worker=worker,
        ended_at=ended_at,
    )


def mib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:.0f} MiB"
