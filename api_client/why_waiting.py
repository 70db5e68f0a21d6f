"""Why a queued run waits, in words and fields: what ``GET /api/runs/{id}`` (``waiting``),
``studio-code status`` and ``CodeClient.why_waiting`` say of a run (or an editor test call)
still ``queued``.

The reasons, first that holds:

* ``no_worker``: no live worker serves its queue (none started, or all stopped since it was
  queued); ``other_store``: the only ones serve from another run store;
* ``workers_paused``: every worker of its queue is paused, each with its reason (its run
  store or its runtime is down: docs/operations.md, "Faults");
* ``retry_delay``: its last attempt failed with an outcome its retry policy retries and the
  next one waits out the policy's delay until ``not_before`` (worker.job.retries). After the
  worker reasons: a run no worker would take after its delay says that first;
* ``workflow_cap`` / ``user_cap`` / ``tenant_cap`` / ``fairness``: a workflow run waiting on
  its lane (worker.fair): its workflow, its user or its tenant has as many runs in flight as
  STUDIO_QUEUE_RUN_WORKFLOW_SLOTS, _USER_SLOTS or _TENANT_SLOTS allow, or it waits for its
  share key's turn (its user's, its tenant's: STUDIO_QUEUE_RUN_SHARE_KEY) among
  ``users_waiting``;
* ``queue``: it is in its queue for the next free slot, ``position`` runs ahead of it;
* ``taken``: a worker holds its message and is starting it.

``estimate_s``, when the queue moved lately: the runs ahead (plus itself) over the queue's
throughput of the last THROUGHPUT_WINDOW_S seconds (runs of its kind that ended then). A
non-admin is never told who the other users are: counts only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import redis

from worker.fair import Waiting
from worker.protocol import message_job_id, queue_lists
from worker.registry import WorkerInfo

#: messages read from a queue's lists at most, to place one run (beyond: "more than")
MAX_POSITION_SCAN = 2000
#: the window over which the queue's throughput is measured for ``estimate_s``
THROUGHPUT_WINDOW_S = 300.0


@dataclass
class WhyWaiting:
    queue: str
    held_by: str
    reason: str
    #: runs ahead of it: its user's on their list (user_cap, fairness), the queue's (queue)
    position: int | None = None
    #: users whose turn comes before its user's next one (fairness)
    users_ahead: int | None = None
    #: users with runs waiting, its own included (user_cap, fairness)
    users_waiting: int | None = None
    #: live workers serving its queue, and their slots
    workers: int = 0
    slots: int = 0
    #: paused workers of its queue: {nodename, reason}
    paused: list[dict[str, Any]] = field(default_factory=list)
    #: seconds until it starts, from the queue's recent throughput (None: cannot tell)
    estimate_s: float | None = None
    #: retry_delay: when its next attempt may start
    not_before: datetime | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def queue_position(client: redis.Redis, queue: str, job_id: str) -> int | None:
    """Messages ahead of ``job_id``'s in ``queue`` (kombu pushes on the left and takes from
    the right of each priority step's list, the first step first); None when it is not in
    the first MAX_POSITION_SCAN messages (taken by a worker, or further back)."""
    pipe = client.pipeline(transaction=True)
    for key in queue_lists(queue):
        pipe.lrange(key, -MAX_POSITION_SCAN, -1)
    ahead = 0
    for items in pipe.execute():
        for raw in reversed(items):
            if message_job_id(raw) == job_id:
                return ahead
            ahead += 1
    return None


def _estimate(ahead: int, done_lately: int) -> float | None:
    if done_lately <= 0:
        return None
    return round((ahead + 1) * THROUGHPUT_WINDOW_S / done_lately, 1)


def explain(
    *,
    queue: str,
    job_id: str,
    infos: list[WorkerInfo],
    store_id: str,
    fair: Waiting | None,
    position: Any,
    done_lately: Any,
    not_before_ts: float | None = None,
    retry_sent: bool = False,
    now_ts: float | None = None,
) -> WhyWaiting:
    """The reason from what was read: the queue's live workers, the run's place on its
    user's list (``fair``), and, read only when needed, ``position()`` (queue_position)
    and ``done_lately()`` (runs of its kind that ended in the window)."""
    serving = [i for i in infos if i.serving]
    ours = [i for i in serving if not (i.store_id and store_id and i.store_id != store_id)]
    paused = [{"nodename": i.nodename, "reason": i.reason} for i in infos if not i.serving]
    base: dict[str, Any] = {
        "queue": queue,
        "workers": len(ours),
        "slots": sum(i.slots for i in ours),
        "paused": paused,
    }
    if fair is not None:  # its place on its user's list, whatever holds it first
        base.update(
            position=fair.position,
            users_ahead=fair.users_ahead,
            users_waiting=fair.users_waiting,
        )
    if not ours:
        if serving:
            return WhyWaiting(
                held_by="other_store",
                reason=f"The workers serving {queue} use another run store than this API: "
                "give the API and the workers the same STUDIO_DATABASE_URL; it waits until "
                "a worker of this store is live.",
                **base,
            )
        if paused:
            why = "; ".join(f"{p['nodename']}: {p['reason']}" for p in paused)
            return WhyWaiting(
                held_by="workers_paused",
                reason=f"Every worker of {queue} is paused ({why}); it starts when one "
                "of them serves again.",
                **base,
            )
        return WhyWaiting(
            held_by="no_worker",
            reason=f"No live worker serves {queue}: it starts once one does (start one "
            "with `studio-code worker`).",
            **base,
        )
    now = datetime.now(UTC).timestamp() if now_ts is None else now_ts
    if not_before_ts is not None and not retry_sent:
        at = datetime.fromtimestamp(not_before_ts, UTC)
        wait = max(0.0, not_before_ts - now)
        then = (
            f"in {wait:.1f} s), then goes to {queue}"
            if wait > 0
            else f"passed): a worker's sweep sends it to {queue} within STUDIO_QUEUE_RETRY_TICK_S"
        )
        return WhyWaiting(
            held_by="retry_delay",
            reason=f"Its last attempt failed with an outcome its retry policy retries; the "
            f"next attempt waits out the policy's delay until {at.isoformat()} ({then}.",
            **base,
            not_before=at,
            estimate_s=round(wait, 1),
        )
    if fair is not None:
        if fair.cap_kind is not None:
            return WhyWaiting(held_by=fair.held_by, reason=_at_cap(fair), **base)
        if fair.users_ahead is None:
            return WhyWaiting(
                held_by="user_cap",
                reason=f"Its user has the most runs in flight allowed "
                f"(STUDIO_QUEUE_RUN_USER_SLOTS); it goes when one of them ends, after "
                f"{fair.position} more of the user's runs.",
                **base,
            )
        return WhyWaiting(
            held_by="fairness",
            reason=f"It waits for its user's turn: code.run is shared in turns between "
            f"{fair.users_waiting} users with runs waiting, {fair.users_ahead} before its "
            f"user's next turn, and {fair.position} of the user's own runs before it.",
            **base,
        )
    ahead = position()
    if ahead is None:
        return WhyWaiting(
            held_by="taken",
            reason=f"A worker of {queue} has taken it and is starting it (or it is more "
            f"than {MAX_POSITION_SCAN} runs back).",
            **base,
        )
    est = _estimate(ahead, done_lately())
    then = "" if est is None else f"; about {est:g} s at the recent pace"
    return WhyWaiting(
        held_by="queue",
        reason=f"It waits in {queue} for a free slot ({base['slots']} in all): {ahead} "
        f"run(s) ahead of it{then}.",
        **{**base, "position": ahead},
        estimate_s=est,
    )


#: the setting of each cap kind's number
_CAP_SETTINGS = {
    "workflow": "STUDIO_QUEUE_RUN_WORKFLOW_SLOTS",
    "user": "STUDIO_QUEUE_RUN_USER_SLOTS",
    "tenant": "STUDIO_QUEUE_RUN_TENANT_SLOTS",
}


def _at_cap(fair: Waiting) -> str:
    """A run held at a cap of one of its keys, in words: the cap and the key's runs in
    flight (counts only: whose they are is never said)."""
    kind = fair.cap_kind or "user"
    return (
        f"It waits behind its {kind}'s cap of {fair.cap} ({_CAP_SETTINGS[kind]}): "
        f"{fair.cap_held} of its {kind}'s runs are in flight, and it goes when one of them "
        f"ends, after {fair.position} run(s) ahead of it on its list. It is not refused."
    )


def since_window(now: datetime | None = None) -> datetime:
    return (now or datetime.now(UTC)) - timedelta(seconds=THROUGHPUT_WINDOW_S)
