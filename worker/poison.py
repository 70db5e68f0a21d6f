"""Poison messages are set aside: a queue item the worker cannot use goes to a dead-letter
list in Redis, is logged at ERROR and counted; the worker keeps serving.

Where an item can go bad, and who catches it:

* not a kombu message at all (``LPUSH code.run 'not a kombu message'``, JSON that is not a
  message): kombu's Redis channel would raise in the worker's event loop and stop the worker.
  ``PoisonChannel`` (a part of every broker channel, composed in worker.broker) checks
  each item it pops first;
* a message whose body cannot be decoded, of an unknown task, or invalid for Celery:
  ``StudioConsumer`` (worker.consumer.slots) sends it here instead of Celery's log-and-drop;
* a message of our task with arguments that are not one job id: the task itself.

The dead-letter list of queue Q is ``studio:dead:Q`` (e.g. ``studio:dead:code.run``): each
entry is a JSON object ``{"at", "queue", "reason", "item"}`` (``item``: the raw text, cut
at 64 KiB). The list keeps the newest 10,000 entries. Inspect it with
``redis-cli LRANGE studio:dead:code.run 0 -1``; re-send a repaired message with LPUSH to
the queue. The metric is ``studio_code_dead_letters_total{queue,reason}``.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

from kombu.transport import redis as kombu_redis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

from worker.protocol import dead_key

log = logging.getLogger("studio_code.worker")

DEAD_MAX = 10_000
ITEM_MAX_CHARS = 64 * 1024


def _text(item: Any) -> str:
    if isinstance(item, bytes):
        item = item.decode("utf-8", "replace")
    elif not isinstance(item, str):
        try:
            item = json.dumps(item, default=repr)
        except Exception:  # noqa: BLE001
            item = repr(item)
    return item[:ITEM_MAX_CHARS]


def dead_letter(client: Any, queue: str, reason: str, item: Any) -> None:
    """Set ``item`` aside in ``studio:dead:<queue>``, log it at ERROR and count it. Never
    raises: a dead letter that cannot be stored is still logged."""
    text = _text(item)
    log.error(
        "poison message on %s set aside in %s: %s; item: %.300s",
        queue,
        dead_key(queue),
        reason,
        text,
    )
    try:
        entry = json.dumps({"at": time.time(), "queue": queue, "reason": reason, "item": text})
        pipe = client.pipeline()
        pipe.lpush(dead_key(queue), entry)
        pipe.ltrim(dead_key(queue), 0, DEAD_MAX - 1)
        pipe.execute()
    except Exception as e:  # noqa: BLE001
        log.error("could not store the dead letter of %s (%s): it is only in this log", queue, e)
    try:
        from worker import metrics

        metrics.record_dead_letter(queue, reason.split(":")[0][:40])
    except Exception as e:  # noqa: BLE001 - a metric is never worth the worker
        log.warning("dead-letter metric failed: %s", e)


def dead_letter_task(client: Any, request: Any, args: Any, kwargs: Any) -> None:
    """Our task was sent with arguments that are not one job id."""
    queue = ((getattr(request, "delivery_info", None) or {}).get("routing_key")) or "code.run"
    dead_letter(
        client,
        queue,
        "bad arguments: the task takes one job id",
        {"id": getattr(request, "id", None), "args": args, "kwargs": kwargs},
    )


def valid_payload(payload: Any) -> bool:
    """What kombu's virtual Message needs to exist at all."""
    if not isinstance(payload, dict):
        return False
    props = payload.get("properties")
    return isinstance(props, dict) and "delivery_tag" in props and "body" in payload


# --- the broker channel's part (worker.broker composes it) -----------------------------------

if TYPE_CHECKING:
    _ChannelBase = kombu_redis.Channel
else:
    _ChannelBase = object


class PoisonChannel(_ChannelBase):
    """A part of kombu's Redis channels (plain and Sentinel: worker.broker composes them):
    each popped item is checked before it is delivered; a job's channel closed under it
    keeps its message unacked."""

    #: when its BRPOP was last answered (monotonic; 0: never)
    answered_at = 0.0

    def _poison(self, queue: str, reason: str, item: Any) -> None:
        try:
            with self.conn_or_acquire() as client:
                dead_letter(client, queue, reason, item)
        except Exception as e:  # noqa: BLE001
            log.error("poison message on %s (%s) could not be set aside: %s", queue, reason, e)

    def _decode_item(self, queue: str, item: Any) -> Any:
        try:
            payload = loads(bytes_to_str(item))
        except Exception as e:  # noqa: BLE001
            self._poison(queue, f"undecodable: {type(e).__name__}: {e}", item)
            return None
        if not valid_payload(payload):
            self._poison(queue, "not a kombu message: no properties.delivery_tag or body", item)
            return None
        return payload

    def _brpop_read(self, **options: Any) -> bool:
        # kombu's own, with _decode_item instead of loads (kept in step with kombu 5.x)
        try:
            try:
                dest__item = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                self.client.connection.disconnect()
                raise
            # an answer (a message, or none within BRPOP's 1 s): this consumer reaches
            # Redis (worker.upkeep.broker_watch reads it)
            self.answered_at = time.monotonic()
            if dest__item:
                dest, item = dest__item
                dest = bytes_to_str(dest).rsplit(self.sep, 1)[0]
                self._queue_cycle.rotate(dest)
                payload = self._decode_item(dest, item)
                if payload is not None:
                    self.connection._deliver(payload, dest)
                return True
            raise kombu_redis.Empty()
        finally:
            self._in_poll = None  # type: ignore[assignment]
            flush = getattr(self, "_flush_brpop_reauth", None)
            if flush is not None:
                flush()

    def basic_ack(self, delivery_tag: Any, multiple: bool = False) -> None:
        if self.connection is None:
            # A job that outlived its channel (closed when the connection was lost): kombu
            # would fail with an AttributeError that stops the worker. Its message is in
            # the unacked set and comes back, finished, after the visibility timeout.
            log.warning(
                "job message %s: its channel closed when the broker connection was lost; "
                "it comes back after the visibility timeout and is skipped (its job ended)",
                delivery_tag,
            )
            return
        super().basic_ack(delivery_tag, multiple=multiple)

    def close(self) -> None:
        # Celery closes the channels of a lost connection while their jobs still run
        # (worker_cancel_long_running_tasks_on_connection_loss is off): kombu would put
        # their messages back on the queue at once and another worker would run them a
        # second time. They stay in Redis's unacked set: a job that ends is found finished
        # when its message comes back after the visibility timeout.
        keep_running_unacked(self._qos)
        super().close()

    def _get(self, queue: str, timeout: Any = None) -> Any:
        while True:
            with self.conn_or_acquire() as client:
                for pri in self.priority_steps:
                    item = client.rpop(self._q_for_pri(queue, pri))
                    if item:
                        self._maybe_update_queues_expire(client, queue)
                        payload = self._decode_item(queue, item)
                        if payload is None:
                            break  # set aside: look again
                        return payload
                else:
                    self._maybe_update_queues_expire(client, queue)
                    raise kombu_redis.Empty()


def keep_running_unacked(qos: Any) -> None:
    """Forget, in ``qos``, the deliveries of jobs this worker is running now, so closing
    its channel does not requeue them."""
    if qos is None:
        return
    try:
        from celery.worker import state

        running = {r.id for r in state.active_requests}
        if not running:
            return
        for tag, message in list(qos._delivered.items()):
            if (getattr(message, "headers", None) or {}).get("id") in running:
                qos._delivered.pop(tag, None)
    except Exception as e:  # noqa: BLE001 - closing goes on; kombu's restore applies
        log.warning("could not keep the running jobs' messages unacked: %s", e)


# --- consumer-level hooks (StudioConsumer) ----------------------------------------------------


def _queue_of(message: Any) -> str:
    info = getattr(message, "delivery_info", None) or {}
    return str(info.get("routing_key") or info.get("exchange") or "unknown")


def on_bad_message(message: Any, reason: str) -> None:
    """Set a delivered message aside and acknowledge it (it must not come back)."""
    try:
        raw = getattr(message, "_raw", None) or {"body": _text(getattr(message, "body", ""))}
        with message.channel.conn_or_acquire() as client:
            dead_letter(client, _queue_of(message), reason, raw)
    finally:
        try:
            message.ack()
        except Exception as e:  # noqa: BLE001
            log.error("could not acknowledge the poison message: %s", e)
