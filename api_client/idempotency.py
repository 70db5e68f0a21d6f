"""Idempotent submits: a caller's key for "this is the same submit".

A studio worker that crashes, times out or retries between its submit and its own record of
the answer submits again with the same ``Idempotency-Key`` (HTTP), ``idempotency_key``
(``CodeClient.submit``) or ``--idempotency-key`` (``studio-code submit``), and gets the
first job — its id and its current view — whether it is queued, running or ended; never a
second row or message. The key is scoped to the calling user and lives
STUDIO_IDEMPOTENCY_TTL_S (default 24 h) in the run store, under a unique constraint on
(user, the key's SHA-256): concurrent repeats race to one job. The same key with a different
request is refused (``IdempotencyConflict``, HTTP 409), naming the first job.

The key is bounded (1-255 characters of ``A-Z a-z 0-9 - _ . : ~ + / =``: a UUID, a ULID,
base64 all fit; an RFC 8941 string in double quotes, as the IETF draft sends it, has its
quotes taken off) and never stored, logged or counted as such: only its digest is kept.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from executor.errors import CodeInvalid
from executor.models import CodeJob
from executor.store import KeyedJob

#: the HTTP header (the IETF httpapi draft's name, as Stripe and others use it)
HEADER = "Idempotency-Key"
MAX_LENGTH = 255
_KEY = re.compile(rf"[A-Za-z0-9\-_.:~+/=]{{1,{MAX_LENGTH}}}")


class IdempotencyConflict(CodeInvalid):
    """The key already names a job made by a different request: use a new key for a new
    submit. HTTP 409 (``IDEMPOTENCY_CONFLICT``); elsewhere CODE_INVALID."""

    def __init__(self, job_id: str) -> None:
        super().__init__(
            f"This Idempotency-Key was already used for a different request, which made job "
            f"{job_id}: send the same request to get that job again, or a new key for a new "
            "submit."
        )
        self.job_id = job_id


def parse_key(raw: str) -> str:
    """The key as the caller sent it, checked; raises CodeInvalid saying what a key may be."""
    key = raw.strip()
    if len(key) >= 2 and key[0] == key[-1] == '"':
        key = key[1:-1]  # an RFC 8941 sf-string, as the IETF draft writes it
    if not _KEY.fullmatch(key):
        raise CodeInvalid(
            f"The idempotency key is not one: give 1 to {MAX_LENGTH} characters of letters, "
            "digits and - _ . : ~ + / = (a UUID is a good key)."
        )
    return key


def key_hash(key: str) -> str:
    """What the run store keeps of a key: its SHA-256, in hex."""
    return hashlib.sha256(key.encode()).hexdigest()


def request_hash(job: CodeJob) -> str:
    """A digest of what a submit asked for: what makes two submits "the same request".
    The state is compared as JSON (the order of an object's keys does not matter); the
    timeout as the job stores it (capped)."""
    request = {
        "kind": job.kind,
        "language": job.language,
        "code": job.code,
        "state": json.loads(job.state_json),
        "timeout_s": job.timeout_s,
        "memory_bytes": job.memory_bytes,
        "cpus": job.cpus,
    }
    if job.retry is not None:  # only then: the digests of earlier keys stay what they were
        request["retry"] = job.retry.model_dump(mode="json")
    if job.worker_group is not None:  # likewise: a job of another worker group than default
        request["worker_group"] = job.worker_group
    for name in ("tenant", "workflow"):  # likewise: the concurrency keys, when named
        if getattr(job, name):
            request[name] = getattr(job, name)
    text = json.dumps(request, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Keyed:
    """One keyed submit: the key's and the request's digests, and when the key expires."""

    key_hash: str
    request_hash: str
    expires_at: datetime

    @classmethod
    def of(cls, job: CodeJob, key: str, ttl_s: float) -> Keyed:
        return cls(
            key_hash(parse_key(key)),
            request_hash(job),
            datetime.now(UTC) + timedelta(seconds=ttl_s),
        )

    def first_job(self, found: KeyedJob) -> str:
        """The first job's id when ``found`` (the key's row) was made by this same request;
        raises IdempotencyConflict when by another."""
        if found.request_hash != self.request_hash:
            raise IdempotencyConflict(found.job_id)
        return found.job_id
