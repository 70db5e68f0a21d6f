"""The wire contract between ``api_client`` (the studio's API) and the workers.

Queue names, the task name, EVERY ``studio:*`` Redis key (no other module spells one),
kombu's Redis key layout (the lists a queue's messages wait in, the hash of the ones a worker
holds), the one writer of a job's done notice, the signal a cancel sends and the timing rules
derived from Settings. Both sides import THIS module, so they cannot drift apart; it imports
nothing heavy (no Docker, no SQL, no Redis client: the writers take one).
"""

from __future__ import annotations

import json
import math
import signal
from typing import Any

from executor.groups import DEFAULT_GROUP
from executor.runtimes.constants import KILL_GRACE_S
from executor.settings import Settings

#: workflow runs
QUEUE_RUN = "code.run"
#: editor test calls: a worker keeps STUDIO_QUEUE_TEST_SLOTS processes for these alone
QUEUE_TEST = "code.test"
QUEUES = (QUEUE_TEST, QUEUE_RUN)

#: the one task; its only argument is the job id (code and state live in the run store)
TASK_NAME = "studio.code.run_job"

#: what ``revoke(terminate=True)`` sends to the pool process. Not SIGTERM: Celery may send it
#: to a process that has already moved on to another job (it signals a pid, not a job), so
#: the process must survive it and decide for itself; its handler only raises a flag that
#: the running job checks against its OWN cancel flag (see worker.job.tasks).
CANCEL_SIGNAL = signal.SIGUSR2
CANCEL_SIGNAL_NAME = "SIGUSR2"

#: a job started this many times (each time its worker died) is not started again
MAX_ATTEMPTS = 3

_PREFIX = "studio"


def cancel_key(job_id: str) -> str:
    """Set (with a TTL) by ``cancel``: the fast path a running job polls every ~100 ms."""
    return f"{_PREFIX}:cancel:{job_id}"


def done_key(job_id: str) -> str:
    """A list the worker pushes to each time the task body ends for the job; ``wait``
    blocks on it (BLMOVE) instead of polling the run store. The run store stays the truth."""
    return f"{_PREFIX}:done:{job_id}"


def lost_key(job_id: str) -> str:
    """A list of the attempts of a job whose sandbox the infrastructure killed (each a JSON
    object: attempt, cause, worker), pushed before the job is handed back; the next attempt
    reads it for its trace row (worker.job.rerun)."""
    return f"{_PREFIX}:lost:{job_id}"


def rate_key(user: str) -> str:
    """The sorted set of one user's editor test calls in the last minute."""
    return f"{_PREFIX}:rate:test:{user or '-'}"


DONE_TTL_S = 600


#: A done notice carries the job's finished record (JSON, as ``CodeClient.status`` returns
#: it: no code or state) when it is at most this many bytes, so the waiter it wakes answers without
#: reading the run store back. A longer record, a run that did not finish the job and a
#: parked result leave "1" (the waiter reads the store). Redis keeps a notice DONE_TTL_S, so
#: it holds at most this much per job ended in that time.
NOTICE_RECORD_MAX = 4096


def notice_item(record: Any = None) -> str:
    """What a done notice pushes: ``record`` (a finished JobRecord) as JSON if it is short
    enough, else "1"."""
    if record is None or len(record.logs) > NOTICE_RECORD_MAX:
        return "1"
    text = str(record.model_dump_json())
    return text if len(text.encode()) <= NOTICE_RECORD_MAX else "1"  # bytes, in Redis


def record_of_notice(item: Any) -> Any:
    """The finished JobRecord a done notice carries, or None: "1", nothing, or an item this
    version cannot read (the waiter reads the store, as for any notice)."""
    if item is None or item in (b"1", "1"):
        return None
    from executor.store.base import JobRecord

    try:
        rec = JobRecord.model_validate_json(item)
    except ValueError:
        return None
    return rec if rec.finished else None


def announce_done(client: Any, job_id: str) -> None:
    """THE done notice (every writer uses this one): wake ``CodeClient.wait`` with one item
    per time the task body ended for the job (or a parked result was written). One round
    trip, no MULTI/EXEC: the TTL only bounds a forgotten list. Raises redis.RedisError."""
    pipe = client.pipeline(transaction=False)
    add_done_notice(pipe, job_id)
    pipe.execute()


def add_done_notice(pipe: Any, job_id: str, record: Any = None) -> None:
    """The done notice's two commands, added to a pipeline that other steps of a job's end
    share (a pool process sends its job's end in one round trip: worker.job.tasks);
    ``record``: the finished JobRecord this run wrote, carried to the waiters if short."""
    pipe.rpush(done_key(job_id), notice_item(record))
    pipe.expire(done_key(job_id), DONE_TTL_S)


def visibility_timeout_s(settings: Settings) -> float:
    """How long Redis lets a worker hold a message (acks_late: until the job ENDS) before
    it hands the message to another worker.

    It must be longer than the longest a delivered message can wait inside a worker plus
    the job's own run: the worker prefetches one message per free slot, so a message starts
    at once (at most it waits for one job that is finishing a cancel: up to
    STUDIO_CODE_MAX_SECONDS), then runs up to STUDIO_CODE_MAX_SECONDS, then the kill grace
    and the container's removal. Too short, and a job that is still running is handed to
    a second worker and runs twice (the run store keeps only one result, but the code ran
    twice). Too long, and a job whose worker died waits that long to be redelivered.
    Hence 2 x STUDIO_CODE_MAX_SECONDS + 120 s by default."""
    if settings.queue_visibility_timeout_s > 0:
        return float(settings.queue_visibility_timeout_s)
    return 2 * settings.code_max_seconds + 120.0


#: beyond the longest wait of a live worker's reserved message: its pool's busy moments
HELD_MARGIN_S = 30.0


def held_lost_after_s(settings: Settings) -> float:
    """How long a message may sit delivered (in kombu's ``unacked`` hash) while its job is
    still ``queued`` before the queued sweep takes it for lost and sends the job again
    (worker.upkeep.queued). A live worker claims a delivered message at once, or after at
    most one running job's end (STUDIO_CODE_MAX_SECONDS + the kill grace); past that, its
    holder lost it (a connection lost with a Redis primary that a failover replaced: the
    message was replicated as delivered, the worker dropped it). Never shorter than
    STUDIO_QUEUE_LOST_AFTER_S. A copy sent again claims only a queued job, and so does the
    first holder's: the job runs once whoever is first. STUDIO_QUEUE_HELD_LOST_AFTER_S,
    when set, instead."""
    if settings.queue_held_lost_after_s > 0:
        return float(settings.queue_held_lost_after_s)
    return max(
        float(settings.queue_lost_after_s),
        settings.code_max_seconds + KILL_GRACE_S + HELD_MARGIN_S,
    )


def restore_interval_s(settings: Settings) -> float:
    """How often a worker looks for messages whose visibility timeout has passed."""
    return max(1.0, min(10.0, visibility_timeout_s(settings) / 4))


def restore_mutex_s(settings: Settings) -> int:
    """How long kombu's restore lock (``unacked_mutex``, taken by a worker for each pass that
    sends dead workers' messages back) lives when its holder dies holding it: one restore
    interval, not kombu's 300 s. A worker SIGKILLed mid-pass otherwise stopped every worker's
    restores for five minutes, past ``stuck_after_s``: a dead worker's running job waited
    that long for its redelivery (seen in a test: a job re-run 5 min after its worker's
    SIGKILL). A pass takes milliseconds (at most 10 messages); two passes at once are safe,
    each message's restore is a WATCHed transaction that only one of them carries out."""
    return max(1, math.ceil(restore_interval_s(settings)))


def stuck_after_s(settings: Settings) -> float:
    """Grace past a job's started_at + timeout before the reaper fails a running job:
    redelivery (visibility timeout + a restore sweep) gets its chance first."""
    return visibility_timeout_s(settings) + 2 * restore_interval_s(settings) + KILL_GRACE_S


def cancel_flag_ttl_s(settings: Settings) -> int:
    """A cancel flag outlives every delivery of the job it names."""
    return int(visibility_timeout_s(settings) + settings.code_max_seconds + 60)


# --- who serves which queue, and notices a worker leaves for the API --------------------------

#: Celery message headers an API adds to each job (old workers ignore them): the identity of
#: the run store that holds the job, so a worker on ANOTHER store can say so (see
#: ``notice_key``) instead of skipping the job silently.
HEADER_STORE_ID = "studio_store_id"
HEADER_STORE_URL = "studio_store"


def job_headers(store_id: str, store_url: str) -> dict[str, str]:
    """The headers sent with a job (``store_url`` without its password)."""
    return {HEADER_STORE_ID: store_id, HEADER_STORE_URL: store_url}


def workers_key(queue: str) -> str:
    """A hash per queue: field = a worker's nodename, value = JSON ``{"nodename", "queue",
    "slots", "state" ("serving" | "paused"), "reason", "host", "pid", "store_id",
    "seen_at", "expires_at"}`` (times in Redis's clock, Unix seconds). A field whose
    ``expires_at`` has passed is a dead worker's (readers ignore and remove it); the whole
    key expires when every worker of the queue is gone. See worker.upkeep.heartbeat."""
    return f"{_PREFIX}:workers:{queue}"


def heartbeat_ttl_s(settings: Settings) -> float:
    """How long one announcement counts: three missed beats and a second of slack."""
    return 3 * settings.queue_heartbeat_interval_s + 1.0


def notice_key(job_id: str) -> str:
    """JSON ``{"code", "message"}`` a worker leaves when it cannot run a job it received
    (its run store has no such job: API and worker on different stores). The API's
    ``status``/``wait`` read it and end the job with that error in ITS store."""
    return f"{_PREFIX}:notice:{job_id}"


def leave_notice(client: Any, job_id: str, code: str, message: str) -> None:
    """Leave the notice of ``notice_key`` (kept DONE_TTL_S). Raises redis.RedisError."""
    client.set(notice_key(job_id), json.dumps({"code": code, "message": message}), ex=DONE_TTL_S)


#: a lock one worker holds while it sweeps the queued jobs (one sweep per interval for all)
SWEEP_LOCK_KEY = f"{_PREFIX}:sweep:queued"


def max_wait_s(settings: Settings, queue: str) -> float:
    """How long a job may wait in ``queue`` before it ends failed (0: no bound)."""
    if kind_of_queue(queue) == "test":
        return float(settings.queue_test_max_wait_s)
    return float(settings.queue_run_max_wait_s)


def queue_of(kind: str, group: str | None = None) -> str:
    """The queue a job of ``kind`` ('run' | 'test') of worker group ``group`` goes to (None
    or "default": code.run / code.test; another group: code.run.GROUP / code.test.GROUP)."""
    base = QUEUE_TEST if kind == "test" else QUEUE_RUN
    return base if not group or group == DEFAULT_GROUP else f"{base}.{group}"


def group_queues(group: str | None) -> tuple[str, str]:
    """The two queues of a worker group (test calls, workflow runs), as QUEUES is the
    default group's."""
    return (queue_of("test", group), queue_of("run", group))


def kind_of_queue(queue: str) -> str:
    """'test' for a queue of editor test calls (of any group), else 'run'."""
    return "test" if queue == QUEUE_TEST or queue.startswith(QUEUE_TEST + ".") else "run"


def group_of_queue(queue: str) -> str:
    """The worker group whose queue ``queue`` is."""
    for base in (QUEUE_TEST, QUEUE_RUN):
        if queue.startswith(base + "."):
            return queue[len(base) + 1 :]
    return DEFAULT_GROUP


def never_taken_message(settings: Settings, queue: str) -> str:
    """Why a job that waited past its queue's bound ended failed."""
    test = kind_of_queue(queue) == "test"
    name = "STUDIO_QUEUE_TEST_MAX_WAIT_S" if test else "STUDIO_QUEUE_RUN_MAX_WAIT_S"
    group = group_of_queue(queue)
    start = "studio-code worker" + ("" if group == DEFAULT_GROUP else f" --group {group}")
    return (
        f"No worker took this job within {max_wait_s(settings, queue):g} s ({name}) on "
        f"queue {queue}: start a worker (`{start}`) or check the running ones "
        "(their logs, GET /healthz/ready), then run it again."
    )


# --- the other studio:* keys ------------------------------------------------------------------


def in_flight_key(user: str) -> str:
    """The sorted set of one user's editor test calls that are waiting for their result
    (api_client.http.inflight)."""
    return f"{_PREFIX}:inflight:test:{user or '-'}"


#: the set of job ids whose result is parked in Redis while the run store is down
PENDING_SET = f"{_PREFIX}:pending"


def pending_key(job_id: str) -> str:
    """A parked result: JSON ``{"worker", "result"}`` (worker.parked), with a TTL of
    STUDIO_QUEUE_PENDING_TTL_S."""
    return f"{_PREFIX}:pending:{job_id}"


#: a live-logs stream expires this long after its last entry
LIVE_TTL_S = 600


def logs_key(job_id: str) -> str:
    """The live-logs stream of a running job: entries ``{"d": <bytes>}``, then
    ``{"end": "1"}`` (worker.job.log_publisher writes it, api_client.log_follower reads it)."""
    return f"{_PREFIX}:logs:{job_id}"


DEAD_PREFIX = f"{_PREFIX}:dead:"


def dead_key(queue: str) -> str:
    """The dead-letter list of ``queue`` (worker.poison)."""
    return f"{DEAD_PREFIX}{queue}"


# --- kombu's Redis key layout (transport options at their defaults) --------------------------
# Read from kombu's own source (kombu/transport/redis.py: Channel.sep, PRIORITY_STEPS,
# _q_for_pri, unacked_key); tests/test_protocol.py fails loudly when a kombu release changes it.

#: between a queue's name and a priority step in the name of that step's list
KOMBU_PRIORITY_SEP = "\x06\x16"
#: kombu's priority steps; step 0 is the bare queue name
KOMBU_PRIORITY_STEPS = (0, 3, 6, 9)
#: the hash of messages delivered to a consumer and not yet acknowledged: delivery tag ->
#: JSON ``[payload, exchange, routing_key]``
KOMBU_UNACKED = "unacked"
#: the sorted set of those delivery tags by delivery time (kombu's restore sweep reads it)
KOMBU_UNACKED_INDEX = "unacked_index"


def message_job_id(raw: Any) -> str | None:
    """The job id of a kombu message as a queue list holds it (JSON text, or parsed); None
    for anything else (a poison item: not ours to judge here)."""
    try:
        payload = json.loads(raw) if isinstance(raw, str | bytes) else raw
        return str(payload["headers"]["id"])
    except (ValueError, KeyError, TypeError):
        return None


def queue_lists(queue: str) -> list[str]:
    """The Redis lists holding ``queue``'s waiting messages, one per priority step."""
    return [queue if p == 0 else f"{queue}{KOMBU_PRIORITY_SEP}{p}" for p in KOMBU_PRIORITY_STEPS]


# --- fair share of code.run between users (worker.fair) ------------------------------------

#: STUDIO_QUEUE_RUN_FAIRNESS values: "users" (runs wait per user and are released into
#: code.run in turns), "off" (runs go straight to code.run, one FIFO for everyone)
FAIRNESS_MODES = ("users", "off")

#: a Celery message header the API adds to a workflow run when fairness is on: the run's
#: user. The broker channel (worker.fair.FairChannel) puts such a message on the user's
#: waiting list instead of code.run; released, the same message goes to code.run.
HEADER_FAIR_USER = "studio_fair_user"
#: beside it, when the submit named them: the run's tenant and workflow (its concurrency
#: keys; worker.fair puts the run on the lane of its tenant, user and workflow)
HEADER_FAIR_TENANT = "studio_fair_tenant"
HEADER_FAIR_WORKFLOW = "studio_fair_workflow"
#: beside HEADER_FAIR_USER on a message the workers send again for a job sent before (a
#: retry's next attempt, a lost message): worker.fair admits it once (``again``)
HEADER_FAIR_AGAIN = "studio_fair_again"

#: STUDIO_QUEUE_RUN_SHARE_KEY values: what takes turns in code.run (worker.fair)
SHARE_KEYS = ("user", "tenant", "tenant/user")

_FAIR = f"{_PREFIX}:fair"
#: the prefix of the keys worker/fair.lua names itself (per flow: ``lanes:<flow>``; per
#: capped key: ``parked:<key>``)
FAIR_PREFIX = f"{_FAIR}:"
#: the key of one lane's waiting list is this prefix + the lane: the user ("" for runs
#: without one) when the run names no tenant nor workflow, else the JSON array
#: ["tenant","user","workflow"] (worker.fair.lane_of)
FAIR_WAIT_PREFIX = f"{_FAIR}:wait:"
#: ZSET flow -> virtual start time: flows (share-key values) with a lane that may go
FAIR_USERS_KEY = f"{_FAIR}:users"
#: HASH flow -> virtual start time: flows with runs waiting whose every lane is at a cap
FAIR_CAPPED_KEY = f"{_FAIR}:capped"
#: HASH job id -> lane: every run waiting on a lane
FAIR_JOBS_KEY = f"{_FAIR}:jobs"
#: HASH job id -> the kombu message (JSON) to put on code.run when the run is released
FAIR_MESSAGES_KEY = f"{_FAIR}:messages"
#: HASH job id -> lane: runs released into code.run whose job has not ended (the caps)
FAIR_HELD_KEY = f"{_FAIR}:held"
#: HASH key -> how many of FAIR_HELD_KEY's runs are of that key (u:<user>, t:<tenant>,
#: w:<tenant>/<workflow>, f:<flow>)
FAIR_HELD_COUNT_KEY = f"{_FAIR}:held_count"
#: ZSET flow -> runs waiting (what meta and /metrics rank)
FAIR_COUNTS_KEY = f"{_FAIR}:counts"
#: HASH job id -> its arrival number (a lane's order among its flow's lanes), and the
#: counter that numbers them
FAIR_SEQ_KEY = f"{_FAIR}:seq"
FAIR_SEQ_NEXT_KEY = f"{_FAIR}:seq_next"
#: HASH lane -> the key at its cap it is parked on; HASH key kind (u, t, w) -> lanes parked
FAIR_PARKED_KEY = f"{_FAIR}:parked"
FAIR_PARKED_KINDS_KEY = f"{_FAIR}:parked_kinds"
#: HASH job id -> lane: runs whose attempt ended for a retry of the node (their slots
#: freed), the lane their next attempt's message waits on (worker.fair, ``again``)
FAIR_AGAIN_KEY = f"{_FAIR}:again"
#: STRING: the virtual time of the last turn taken (a new user starts there)
FAIR_CLOCK_KEY = f"{_FAIR}:clock"
#: LIST with one item per run waiting on a user's list: its LLEN is what an autoscaler that
#: reads list lengths (KEDA's Redis list scaler) adds to LLEN code.run
FAIR_BACKLOG_KEY = f"{_FAIR}:backlog"

#: code.run may hold this many messages beyond the live workers' run slots ... at least
FAIR_MIN_AHEAD = 2
#: how often each worker's main process releases runs (job ends release at once too)
FAIR_RELEASE_INTERVAL_S = 1.0


def fair_wait_key(user: str) -> str:
    """One user's list of waiting runs (job ids, oldest first)."""
    return f"{FAIR_WAIT_PREFIX}{user}"
