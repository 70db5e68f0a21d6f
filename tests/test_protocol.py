"""kombu's Redis key layout is what worker/protocol.py says it is.

The worker reads kombu's keys itself (the queued sweep looks for lost messages in the queue
lists and the ``unacked`` hash, the API's backlog gauge is LLEN of the lists). A kombu release
that named them otherwise would make those readers see empty queues without an error: these
tests send real messages through the project's Celery app and broker transport to a real
redis-server and fail loudly when the keys kombu made differ from protocol.py's.
"""

from __future__ import annotations

import json
from bisect import bisect
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from worker.assembly import make_app
from worker.protocol import (
    KOMBU_PRIORITY_STEPS,
    KOMBU_UNACKED,
    KOMBU_UNACKED_INDEX,
    QUEUE_RUN,
    QUEUE_TEST,
    QUEUES,
    TASK_NAME,
    queue_lists,
    restore_interval_s,
    restore_mutex_s,
    stuck_after_s,
    visibility_timeout_s,
)
from worker.upkeep.queued import broker_job_ids

pytestmark = [pytest.mark.redis]

#: every priority a message may carry, and the step kombu files each under
PRIORITIES = (0, 1, 3, 4, 6, 8, 9)


@pytest.fixture
def broker(redis_server: Any, make_settings: Any) -> Iterator[tuple[Any, redis.Redis]]:
    """The project's Celery app (its broker layer's transport, as every process has it), and a
    client of the same Redis."""
    app = make_app(make_settings(redis_url=redis_server.url))
    client = redis.Redis.from_url(redis_server.url)
    try:
        yield app, client
    finally:
        client.close()
        app.close()


def _send(app: Any, queue: str, job_id: str, priority: int) -> None:
    app.send_task(
        TASK_NAME,
        args=(job_id,),
        task_id=job_id,
        queue=queue,
        priority=priority,
        ignore_result=True,
    )


def _ids_in(client: redis.Redis, key: str) -> set[str]:
    return {json.loads(raw)["headers"]["id"] for raw in client.lrange(key, 0, -1)}


def test_the_lists_kombu_fills_per_priority_are_protocols_queue_lists(
    broker: tuple[Any, redis.Redis],
) -> None:
    app, client = broker
    sent: dict[str, dict[str, int]] = {q: {} for q in QUEUES}
    for queue in QUEUES:
        for p in PRIORITIES:
            job_id = f"{queue}-p{p}"
            _send(app, queue, job_id, p)
            sent[queue][job_id] = p
    lists = {k.decode() for k in client.keys("code.*")}
    assert lists == {k for q in QUEUES for k in queue_lists(q)}, (
        "kombu's Redis transport names a queue's lists differently from "
        "worker.protocol.queue_lists: update protocol.py (and check the queued sweep)"
    )
    for queue in QUEUES:
        keys = queue_lists(queue)
        assert len(keys) == len(KOMBU_PRIORITY_STEPS)
        for job_id, p in sent[queue].items():
            step = bisect(KOMBU_PRIORITY_STEPS, p) - 1
            assert job_id in _ids_in(client, keys[step]), (job_id, keys[step])
        # what the backlog gauge and the sweep count: every message, none twice
        assert sum(int(client.llen(k)) for k in keys) == len(PRIORITIES)
    assert broker_job_ids(client) == {j for q in QUEUES for j in sent[q]}


def test_a_message_taken_without_ack_is_in_protocols_unacked_hash(
    broker: tuple[Any, redis.Redis],
) -> None:
    app, client = broker
    _send(app, QUEUE_TEST, "held-job", 9)
    _send(app, QUEUE_RUN, "waiting-job", 0)
    with app.connection_for_read() as conn:
        channel = conn.default_channel
        message = channel.basic_get(QUEUE_TEST, no_ack=False)
        assert message is not None
        assert message.headers["id"] == "held-job"
        held = client.hgetall(KOMBU_UNACKED)
        assert list(held) == [message.delivery_tag.encode()], (
            f"kombu keeps delivered, unacknowledged messages elsewhere than the "
            f"{KOMBU_UNACKED!r} hash: update worker.protocol.KOMBU_UNACKED"
        )
        payload, exchange, routing_key = json.loads(held[message.delivery_tag.encode()])
        assert payload["headers"]["id"] == "held-job"
        assert routing_key == QUEUE_TEST
        assert client.zscore(KOMBU_UNACKED_INDEX, message.delivery_tag) is not None
        # the sweep sees the held message and the waiting one, none other
        assert broker_job_ids(client) == {"held-job", "waiting-job"}
        assert sum(int(client.llen(k)) for k in queue_lists(QUEUE_TEST)) == 0
        message.ack()
        assert client.hlen(KOMBU_UNACKED) == 0
        assert broker_job_ids(client) == {"waiting-job"}


def test_a_worker_killed_mid_restore_holds_the_restore_lock_one_interval(
    broker: tuple[Any, redis.Redis], make_settings: Any
) -> None:
    """kombu's restore lock (``unacked_mutex``) outlives a holder SIGKILLed mid-pass by its
    expiry; at kombu's 300 s every worker's restores stopped that long, past the reaper's
    ``stuck_after_s``, and a dead worker's job waited five minutes for its redelivery. The
    expiry reaches the channel every worker process uses (read off a real connection), and
    with it a dead worker's messages come back within ``stuck_after_s`` whatever the lock:
    the visibility timeout, one restore interval for the lock, one for the pass."""
    app, client = broker
    settings = make_settings()
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        assert channel.unacked_mutex_expire == restore_mutex_s(settings)
        # the lock a dead holder left is the channel's, with the expiry the channel sets
        from kombu.transport.redis import Mutex

        held = Mutex(client, channel.unacked_mutex_key, channel.unacked_mutex_expire)
        held.__enter__()  # never left: its holder was SIGKILLed
        ttl = client.ttl(channel.unacked_mutex_key)
        assert 0 < ttl <= restore_mutex_s(settings), ttl
    for s in (
        settings,
        make_settings(code_max_seconds=600),
        make_settings(queue_visibility_timeout_s=2),
    ):
        worst = visibility_timeout_s(s) + restore_mutex_s(s) + restore_interval_s(s)
        assert worst <= stuck_after_s(s), (worst, stuck_after_s(s))
