"""Jobs a worker received but cannot run from its run store, each said plainly instead of
skipped or left ``running``:

* **Unknown id**: the worker's store has no such job. The API that sent it uses ANOTHER
  store (they disagree on STUDIO_DATABASE_URL / STUDIO_DATA_DIR). The worker logs it at
  ERROR and leaves a notice in Redis (``protocol.notice_key``) naming both stores; the
  API's ``status``/``wait`` end the job failed with it, in the API's store.
* **Unreadable row**: a column the worker cannot read (a language it does not know,
  corrupted JSON). The job is not run; it ends failed with what could not be read.
"""

from __future__ import annotations

import logging
from typing import Any

import redis

from executor.errors import ErrorCode
from executor.store import JobRecord, RunStore
from worker.protocol import HEADER_STORE_ID, HEADER_STORE_URL, leave_notice

log = logging.getLogger("studio_code.worker")


def unknown_job(
    store: RunStore, client: redis.Redis, job_id: str, request: Any, worker: str
) -> None:
    """The claim found no ``job_id`` in ``store`` (``Claim.unknown``): log at ERROR and
    leave the notice."""
    mine = store.describe()
    try:
        mine_id = store.store_id
    except Exception:  # noqa: BLE001 - its id is read once, and is not what matters here
        mine_id = "unknown"
    theirs = getattr(request, HEADER_STORE_URL, None) or "an unknown store"
    theirs_id = getattr(request, HEADER_STORE_ID, None) or "unknown"
    message = (
        f"The worker {worker} received this job but its run store ({mine}, store id "
        f"{mine_id}) has no such job; the API that queued it uses {theirs} (store id "
        f"{theirs_id}). Give the API and every worker the same STUDIO_DATABASE_URL (or "
        "STUDIO_DATA_DIR), then run it again."
    )
    log.error("job %s is not in this worker's run store: %s", job_id, message)
    try:
        leave_notice(client, job_id, str(ErrorCode.RUNTIME_UNAVAILABLE), message)
    except redis.RedisError as e:
        log.warning("could not leave the notice of job %s: %s", job_id, e)


def unreadable_message(rec: JobRecord) -> str:
    """Why a job whose row could not be read was not run."""
    return (
        "The run store's row of this job cannot be read ("
        + "; ".join(rec.problems)
        + "), so it was not run: a worker older than the API that queued it, or a "
        "damaged row. Update the workers, then run it again."
    )
