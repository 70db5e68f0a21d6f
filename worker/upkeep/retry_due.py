"""The next attempt of a retried node, sent when its delay has passed (worker.job.retries).

Every worker's janitor looks every STUDIO_QUEUE_RETRY_TICK_S: queued rows whose
``not_before_ts`` has passed and whose message no sweep sent yet. For each, one conditional
UPDATE (``mark_retry_sent``) makes one sweep the sender, which then sends the message (an
early message is refused by ``claim`` anyway). A sweep that dies between the two leaves a
queued row without a message: the lost-message sweep (worker.upkeep.queued) sends it again
STUDIO_QUEUE_LOST_AFTER_S after it was due, as for any lost message. Until a sweep marked
it, the lost-message sweep leaves it alone (``list_queued``), so the two never both send it.

A workflow run's next attempt goes through its group's fair queue, as its first did
(worker.fair, ``again``): on the lane its last attempt had (its user's, tenant's and
workflow's: the lane was kept when that attempt ended; when Redis lost that, the lane of the
keys the run store's row holds), waiting there while one of its keys is at its cap. Its
slot was freed when the attempt ended (``pause``): a run waiting out its delay holds none.
"""

from __future__ import annotations

import logging
from typing import Any

from executor.settings import Settings
from executor.store import RunStore
from worker.fair import fair_headers
from worker.protocol import TASK_NAME, job_headers, queue_of

log = logging.getLogger("studio_code.worker")


def send_due(store: RunStore, app: Any, settings: Settings) -> list[str]:
    """Send the message of every retry attempt now due (at most a batch); the ids sent."""
    sent: list[str] = []
    for due in store.due_retries():
        if not store.mark_retry_sent(due.job_id):
            continue  # another worker's sweep sends it
        app.send_task(
            TASK_NAME,
            args=(due.job_id,),
            task_id=due.job_id,
            queue=queue_of(due.kind, due.worker_group),  # its worker group's
            ignore_result=True,
            headers={
                **job_headers(store.store_id, store.describe()),
                **fair_headers(settings, due.kind, due.user, due.tenant, due.workflow, again=True),
            },
        )
        sent.append(due.job_id)
    if sent:
        log.info("retry sweep: sent %d attempt(s) whose delay passed: %s", len(sent), sent[:20])
    return sent
